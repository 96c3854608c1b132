package runner_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// Instances lists each runner with the job shards it leads, and marks one
// that stopped as not live; Terms records a change of leader as a new term
// with a greater token.
func TestInstancesAndTermsFollowTheFleet(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	noop := func(context.Context, *runner.Run) error { return nil }
	register := func(r *runner.Runner) error {
		if err := r.Register(runner.Job{Name: "tick", Schedule: "@every 200ms", Run: noop}); err != nil {
			return err
		}
		return r.RegisterSharded(runner.Job{Name: "part", Schedule: "@every 200ms", Run: noop}, 4)
	}
	ins := map[string]*instance{}
	for _, who := range []string{"a", "b"} {
		ins[who] = start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: who, TTL: time.Second, PollInterval: 100 * time.Millisecond},
			runner.Config{}, register)
	}
	leads := func(list []runner.InstanceInfo) map[string][]runner.Lead {
		m := map[string][]runner.Lead{}
		for _, ii := range list {
			if ii.Live {
				m[ii.ID] = ii.Leads
			}
		}
		return m
	}
	var list []runner.InstanceInfo
	waitFor(t, 15*time.Second, "both instances live, leading all five job shards between them", func() bool {
		var err error
		if list, err = runner.Instances(ctx, db.Pool, db.Schema); err != nil {
			t.Fatal(err)
		}
		m := leads(list)
		return len(m) == 2 && len(m["a"])+len(m["b"]) == 5
	})
	for _, ii := range list {
		if !slices.Contains(ii.Jobs, "part") || ii.StartedAt.IsZero() || !ii.ExpiresAt.After(ii.Now) {
			t.Fatalf("instance %+v: want the sharded job registered, and an expiry after now", ii)
		}
		for _, l := range ii.Leads {
			if !l.Token.Valid() || (l.Job == "tick" && l.Shard != 0) || l.Shard > 3 {
				t.Fatalf("lead %+v of %s", l, ii.ID)
			}
		}
	}
	waitFor(t, 10*time.Second, "tick to run", func() bool {
		terms, err := runner.Terms(ctx, db.Pool, db.Schema, 0)
		return err == nil && slices.ContainsFunc(terms, func(tm runner.Term) bool { return tm.Job == "tick" })
	})
	first := holderOf(t, db, "pgfence/job/tick")
	other := map[string]string{"a": "b", "b": "a"}[first]
	ins[first].stop(t)
	waitFor(t, 15*time.Second, "the stopped instance marked not live, the other leading everything", func() bool {
		list, err := runner.Instances(ctx, db.Pool, db.Schema)
		if err != nil {
			t.Fatal(err)
		}
		m := leads(list)
		_, stillLive := m[first]
		return !stillLive && len(m[other]) == 5
	})
	var terms []runner.Term
	waitFor(t, 10*time.Second, "a second term of tick, by the other instance", func() bool {
		var err error
		terms, err = runner.Terms(ctx, db.Pool, db.Schema, 100)
		if err != nil {
			t.Fatal(err)
		}
		return len(ticks(terms)) >= 2 && ticks(terms)[0].Holder == other
	})
	tk := ticks(terms)
	if tk[0].Token <= tk[1].Token || tk[1].Holder != first || tk[0].FirstRun.Before(tk[1].FirstRun) || tk[0].Attempts < 1 {
		t.Fatalf("terms of tick, newest first: %+v; want the newer term (greater token) by %s after %s's", tk, other, first)
	}
	if _, err := runner.Terms(ctx, db.Pool, db.Schema, -1); err == nil {
		t.Fatal("Terms with a negative limit: no error")
	}
}

func ticks(terms []runner.Term) []runner.Term {
	var out []runner.Term
	for _, t := range terms {
		if t.Job == "tick" {
			out = append(out, t)
		}
	}
	return out
}

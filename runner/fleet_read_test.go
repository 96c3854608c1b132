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
	var (
		list []runner.InstanceInfo
		err  error
	)
	waitFor(t, 15*time.Second, "both instances live, leading all five job shards between them", func() bool {
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
		terms, err := runner.Terms(ctx, db.Pool, db.Schema, runner.TermFilter{})
		return err == nil && slices.ContainsFunc(terms, func(tm runner.Term) bool { return tm.Job == "tick" })
	})
	first := holderOf(t, db, "pgfence/job/tick")
	other := map[string]string{"a": "b", "b": "a"}[first]
	startedAt := func(list []runner.InstanceInfo, id string) (time.Time, *time.Time) {
		for _, ii := range list {
			if ii.ID == id {
				return ii.StartedAt, ii.StoppedAt
			}
		}
		t.Fatalf("no instance %s in %+v", id, list)
		return time.Time{}, nil
	}
	began, _ := startedAt(list, first)
	ins[first].stop(t)
	waitFor(t, 15*time.Second, "the stopped instance marked not live, the other leading everything", func() bool {
		if list, err = runner.Instances(ctx, db.Pool, db.Schema); err != nil {
			t.Fatal(err)
		}
		m := leads(list)
		_, stillLive := m[first]
		return !stillLive && len(m[other]) == 5
	})
	// A clean stop is recorded as such (a crash leaves StoppedAt nil: the
	// fleet page tells "stopped" from "gone").
	if _, stopped := startedAt(list, first); stopped == nil {
		t.Fatalf("instance %s stopped cleanly, but StoppedAt is nil", first)
	}
	var terms []runner.Term
	waitFor(t, 10*time.Second, "a second term of tick, by the other instance, that ran it", func() bool {
		var err error
		terms, err = runner.Terms(ctx, db.Pool, db.Schema, runner.TermFilter{Limit: 100})
		if err != nil {
			t.Fatal(err)
		}
		return len(ticks(terms)) >= 2 && ticks(terms)[0].Holder == other && ticks(terms)[0].Attempts >= 1
	})
	tk := ticks(terms)
	if tk[0].Token <= tk[1].Token || tk[1].Holder != first || tk[0].FirstRun.Before(tk[1].FirstRun) || tk[0].Attempts < 1 {
		t.Fatalf("terms of tick, newest first: %+v; want the newer term (greater token) by %s after %s's", tk, other, first)
	}
	if _, err := runner.Terms(ctx, db.Pool, db.Schema, runner.TermFilter{Limit: -1}); err == nil {
		t.Fatal("Terms with a negative limit: no error")
	}
	// Started again under the same identity, it shows its own start time
	// and is no longer stopped.
	ins[first] = start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: first, TTL: time.Second, PollInterval: 100 * time.Millisecond},
		runner.Config{}, register)
	waitFor(t, 15*time.Second, "the restarted instance live", func() bool {
		if list, err = runner.Instances(ctx, db.Pool, db.Schema); err != nil {
			t.Fatal(err)
		}
		_, live := leads(list)[first]
		return live
	})
	if again, stopped := startedAt(list, first); !again.After(began) || stopped != nil {
		t.Fatalf("restarted %s: started %v (first start %v), stopped %v; want a later start and not stopped", first, again, began, stopped)
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

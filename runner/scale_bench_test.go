package runner_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// BenchmarkShardFleet measures a fleet at scale: 8 instances
// in one process start together with 1,024 shards of one job and 5-connection
// pools, default timings (TTL 15s, RebalanceInterval 5s, PollInterval 1s).
// It reports the acquisitions per shard until every shard has run, leases
// lost on the way, the time until every shard has run, the balance (max/min
// shards per instance), and, for a ninth instance joining and then one
// leaving gracefully, the shards moved and the time until the new owners
// hold them. The instances start at once ("together") or one every 250 ms
// ("staggered", as an orchestrator starts replicas). The scenario runs once
// whatever b.N: run it with -benchtime=1x.
//
//	go test -run '^$' -bench BenchmarkShardFleet -benchtime=1x ./runner
func BenchmarkShardFleet(b *testing.B) {
	for _, stagger := range []time.Duration{0, 250 * time.Millisecond} {
		name := "together"
		if stagger > 0 {
			name = "staggered"
		}
		b.Run(name, func(b *testing.B) { shardFleet(b, stagger) })
	}
}

func shardFleet(b *testing.B, stagger time.Duration) {
	const (
		shards    = 1024
		instances = 8
	)
	db := pgtest.New(b)
	var gained, lost atomic.Int64
	onEvent := func(e runner.Event) {
		switch {
		case e.Kind == runner.LeadershipGained:
			gained.Add(1)
		case e.Kind == runner.LeadershipLost && errors.Is(e.Err, lock.ErrLeaseLost):
			lost.Add(1)
		}
	}
	job := runner.Job{Name: "fleet", Schedule: "@every 1s", Run: func(ctx context.Context, run *runner.Run) error {
		return run.CommitTx(ctx, func(pgx.Tx) error { return nil })
	}}
	launch := func(who string) *instance {
		pool := pgtest.NewPool(b, "fleet-"+who, func(c *pgxpool.Config) { c.MaxConns = 5 })
		return start(b, pool, lock.Config{Schema: db.Schema, Holder: who}, runner.Config{OnEvent: onEvent},
			func(r *runner.Runner) error { return r.RegisterSharded(job, shards) })
	}
	holders := func() map[int]string {
		rows, err := db.Pool.Query(context.Background(), "SELECT split_part(name, '/', 4)::int, holder FROM "+tbl(db, "pgfence_lease_states")+
			" WHERE name LIKE 'pgfence/job/fleet/%' AND holder IS NOT NULL AND expires_at > now()")
		if err != nil {
			b.Fatal(err)
		}
		defer rows.Close()
		m := map[int]string{}
		for rows.Next() {
			var (
				s int
				h string
			)
			if err := rows.Scan(&s, &h); err != nil {
				b.Fatal(err)
			}
			m[s] = h
		}
		return m
	}
	settledOn := func(who map[string]bool) func() bool {
		return func() bool {
			h := holders()
			if len(h) != shards {
				return false
			}
			for _, o := range h {
				if !who[o] {
					return false
				}
			}
			return true
		}
	}
	b.ResetTimer()
	began := time.Now()
	ins := map[string]*instance{}
	live := map[string]bool{}
	for i := range instances {
		who := fmt.Sprintf("i%d", i)
		ins[who], live[who] = launch(who), true
		time.Sleep(stagger)
	}
	waitFor(b, 5*time.Minute, "every shard to run", func() bool {
		return queryInt(b, db, "SELECT count(DISTINCT shard) FROM "+tbl(db, "pgfence_runs")+" WHERE status = 'succeeded'") == shards
	})
	allRan := time.Since(began)
	acq, lostAtStart := gained.Load(), lost.Load()
	waitFor(b, time.Minute, "the fleet to settle", settledOn(live))
	load := map[string]int{}
	for _, o := range holders() {
		load[o]++
	}
	lo, hi := shards, 0
	for w := range live {
		lo, hi = min(lo, load[w]), max(hi, load[w])
	}

	before := holders()
	joined := time.Now()
	ins["i8"], live["i8"] = launch("i8"), true
	waitFor(b, time.Minute, "the join to settle", func() bool {
		h := holders()
		n := 0
		for _, o := range h {
			if o == "i8" {
				n++
			}
		}
		return len(h) == shards && n >= shards/9
	})
	joinTook, afterJoin := time.Since(joined), holders()
	left := time.Now()
	ins["i0"].stop(b)
	delete(live, "i0")
	waitFor(b, time.Minute, "the leave to settle", settledOn(live))
	leaveTook, afterLeave := time.Since(left), holders()
	b.StopTimer()
	moved := func(x, y map[int]string) int {
		n := 0
		for s := range shards {
			if x[s] != y[s] {
				n++
			}
		}
		return n
	}
	b.ReportMetric(float64(acq)/shards, "acquisitions/shard_at_start")
	b.ReportMetric(float64(lostAtStart), "leases_lost_at_start")
	b.ReportMetric(allRan.Seconds(), "s_until_every_shard_ran")
	b.ReportMetric(float64(hi)/float64(max(lo, 1)), "max/min_shards_per_instance")
	b.ReportMetric(float64(moved(before, afterJoin)), "moved_on_join")
	b.ReportMetric(joinTook.Seconds(), "s_join_settled")
	b.ReportMetric(float64(moved(afterJoin, afterLeave)), "moved_on_leave")
	b.ReportMetric(leaveTook.Seconds(), "s_leave_settled")
	for w, in := range ins {
		if live[w] {
			in.stop(b)
		}
	}
}

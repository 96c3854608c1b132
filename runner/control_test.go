package runner_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// Pause is honoured by every replica from its next slot: the slots that
// fall due while paused are recorded as skipped ("paused"), by whichever
// replica leads, also after leadership moves; a replica that starts keeps
// the pause; no scheduled slot runs, a manual run does; after Resume the
// job runs again.
func TestPauseHoldsOnEveryReplica(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, 2*time.Minute)
	runs := tbl(db, "pgfence_runs")
	job := runner.Job{Name: "tick", Schedule: "@every 200ms", Run: func(context.Context, *runner.Run) error { return nil }}
	ins := map[string]*instance{}
	for _, who := range []string{"a", "b", "c"} {
		ins[who] = start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: who, TTL: time.Second, PollInterval: 100 * time.Millisecond},
			runner.Config{}, func(r *runner.Runner) error { return r.Register(job) })
	}
	waitFor(t, 10*time.Second, "two slots to succeed", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE status = 'succeeded'") >= 2
	})
	if err := runner.Pause(ctx, db.Pool, db.Schema, "tick", "the test"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "three slots skipped", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE status = 'skipped' AND error = 'paused'") >= 3
	})
	// The leader goes away while the job is paused: the next one skips too.
	first := holderOf(t, db, "pgfence/job/tick")
	ins[first].stop(t)
	waitFor(t, 10*time.Second, "a second replica to skip slots", func() bool {
		return queryInt(t, db, "SELECT count(DISTINCT holder) FROM "+runs+" WHERE status = 'skipped'") >= 2
	})
	waitFor(t, 10*time.Second, "jobs status to name the next leader", func() bool {
		jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "tick")
		return err == nil && len(jobs) == 1 && jobs[0].Leader != "" && jobs[0].Leader != first
	})
	jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "tick")
	if err != nil || len(jobs) != 1 || !jobs[0].Paused || jobs[0].PausedBy != "the test" ||
		jobs[0].Last == nil || jobs[0].Last.Status != runner.StatusSkipped {
		t.Fatalf("Jobs while paused: %+v, %v", jobs, err)
	}
	// A replica that starts while the job is paused registers the job
	// again and keeps the pause.
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "d", TTL: time.Second, PollInterval: 100 * time.Millisecond},
		runner.Config{}, func(r *runner.Runner) error { return r.Register(job) })
	waitFor(t, 10*time.Second, "d to register and heartbeat", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_jobs")+" WHERE registered_by = 'd'") == 1 &&
			queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_instances")+" WHERE id = 'd'") == 1
	})
	// A manual run still runs while the job is paused.
	refs, err := runner.RunNow(ctx, db.Pool, db.Schema, "tick", 0, "the test")
	if err != nil {
		t.Fatal(err)
	}
	if ri, err := runner.WaitRun(ctx, db.Pool, db.Schema, refs[0]); err != nil || ri.Status != runner.StatusSucceeded {
		t.Fatalf("a manual run while paused: %+v, %v", ri, err)
	}
	if jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "tick"); err != nil || !jobs[0].Paused {
		t.Fatalf("after a replica registered the job again: %+v, %v; want it still paused", jobs, err)
	}
	// Nothing scheduled started after the pause (a claim already under
	// way when Pause committed may start within milliseconds of it).
	if n := queryInt(t, db, "SELECT count(*) FROM "+runs+" r, "+tbl(db, "pgfence_jobs")+` j
		WHERE r.job = j.job AND r.kind = 'scheduled' AND r.status <> 'skipped' AND r.started_at > j.paused_at + interval '50 milliseconds'`); n != 0 {
		t.Fatalf("%d scheduled attempts started while the job was paused", n)
	}
	if err := runner.Resume(ctx, db.Pool, db.Schema, "tick"); err != nil {
		t.Fatal(err)
	}
	resumed := time.Now()
	waitFor(t, 10*time.Second, "a slot to succeed after Resume", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE status = 'succeeded' AND started_at > $1", resumed) >= 1
	})
	if jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "tick"); err != nil || jobs[0].Paused {
		t.Fatalf("Jobs after Resume: %+v, %v", jobs, err)
	}
	for _, err := range []error{runner.Pause(ctx, db.Pool, db.Schema, "nope", "x"), runner.Resume(ctx, db.Pool, db.Schema, "nope")} {
		if !errors.Is(err, runner.ErrUnknownJob) {
			t.Fatalf("pause or resume of an unknown job: %v, want ErrUnknownJob", err)
		}
	}
}

// RunNow, asked from outside the runner (no replica's client), runs the
// job once per request on its leader, woken by the notification (the next
// scheduled slot is an hour away), each recorded as a manual slot with the
// leader's token; a sharded job runs every shard once. Unknown jobs and
// shards are errors.
func TestRunNowRunsEachRequestOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, 2*time.Minute)
	mustExec(t, db, "CREATE TABLE "+tbl(db, "effects")+" (job text, shard int, slot timestamptz, token bigint, PRIMARY KEY (job, shard, slot))")
	effect := func(ctx context.Context, run *runner.Run) error {
		if !run.Manual {
			return errors.New("a scheduled slot ran: the test wants manual runs only")
		}
		return run.CommitTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+tbl(db, "effects")+" VALUES ($1, $2, $3, $4)", run.Job, run.Shard, run.Slot, int64(run.Token))
			return err
		})
	}
	for _, who := range []string{"a", "b"} {
		start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: who}, runner.Config{RebalanceInterval: 200 * time.Millisecond},
			func(r *runner.Runner) error {
				if err := r.Register(runner.Job{Name: "manual", Schedule: "@every 1h", Run: effect}); err != nil {
					return err
				}
				return r.RegisterSharded(runner.Job{Name: "sharded", Schedule: "@every 1h", Run: effect}, 3)
			})
	}
	waitFor(t, 10*time.Second, "every job and shard to have a leader", func() bool {
		jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "")
		if err != nil || len(jobs) != 4 {
			return false
		}
		for _, j := range jobs {
			if j.Leader == "" {
				return false
			}
		}
		return true
	})
	var refs []runner.RunRef
	for i := range 5 {
		r, err := runner.RunNow(ctx, db.Pool, db.Schema, "manual", 0, fmt.Sprint("asker ", i))
		if err != nil || len(r) != 1 {
			t.Fatalf("RunNow: %v, %v", r, err)
		}
		refs = append(refs, r...)
	}
	r, err := runner.RunNow(ctx, db.Pool, db.Schema, "sharded", runner.AllShards, "asker")
	if err != nil || len(r) != 3 {
		t.Fatalf("RunNow of every shard: %v, %v", r, err)
	}
	refs = append(refs, r...)
	for _, ref := range refs {
		ri, err := runner.WaitRun(ctx, db.Pool, db.Schema, ref)
		if err != nil || ri.Status != runner.StatusSucceeded || ri.Kind != runner.KindManual || ri.Attempt != 1 || ri.Token == 0 {
			t.Fatalf("WaitRun(%+v) = %+v, %v", ref, ri, err)
		}
		var token int64
		if err := db.Pool.QueryRow(ctx, "SELECT token FROM "+tbl(db, "effects")+" WHERE job = $1 AND shard = $2 AND slot = $3",
			ref.Job, ref.Shard, ref.Slot).Scan(&token); err != nil || token != int64(ri.Token) {
			t.Fatalf("the effect of %+v: token %d, %v; want one with the run's token %d", ref, token, err, ri.Token)
		}
	}
	if n := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "effects")); n != len(refs) {
		t.Fatalf("%d effects for %d requests", n, len(refs))
	}
	if n := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_runs")+" WHERE kind = 'scheduled'"); n != 0 {
		t.Fatalf("%d scheduled attempts; want none", n)
	}
	jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "manual")
	if err != nil || len(jobs) != 1 || jobs[0].Pending != 0 || jobs[0].Last != nil || jobs[0].Next.IsZero() {
		t.Fatalf("Jobs: %+v, %v", jobs, err)
	}
	if _, err := runner.RunNow(ctx, db.Pool, db.Schema, "nope", 0, "x"); !errors.Is(err, runner.ErrUnknownJob) {
		t.Fatalf("RunNow of an unknown job: %v", err)
	}
	for _, s := range []int{1, -2} {
		if _, err := runner.RunNow(ctx, db.Pool, db.Schema, "manual", s, "x"); !errors.Is(err, runner.ErrNoSuchShard) {
			t.Fatalf("RunNow of shard %d of an unsharded job: %v", s, err)
		}
	}
	if _, err := runner.RunNow(ctx, db.Pool, db.Schema, "sharded", 3, "x"); !errors.Is(err, runner.ErrNoSuchShard) {
		t.Fatalf("RunNow of shard 3 of 3: %v", err)
	}
}

// A replica that does not lead a job observes who does, and learns of the
// next leader by notification (both poll every 30s) when the leader stops.
func TestObserveNamesTheLeader(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	job := runner.Job{Name: "watched", Schedule: "@every 1h", Run: func(context.Context, *runner.Run) error { return nil }}
	logs := pgtest.NewLogs()
	logs.LogOnFailure(t) // a failure shows both replicas' story
	ins := map[string]*instance{}
	for _, who := range []string{"a", "b"} {
		log := slog.New(logs).With("replica", who)
		ins[who] = start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: who, PollInterval: 30 * time.Second, Logger: log,
			OnEvent: func(e lock.Event) { log.Info("lock event", "event", e) }},
			runner.Config{OnEvent: func(e runner.Event) { log.Info("runner event", "event", e) }},
			func(r *runner.Runner) error { return r.Register(job) })
	}
	var leader string
	waitFor(t, 10*time.Second, "a leader", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_leases")+" WHERE name = 'pgfence/job/watched' AND holder IS NOT NULL") == 1
	})
	leader = holderOf(t, db, "pgfence/job/watched")
	other := map[string]string{"a": "b", "b": "a"}[leader]
	seen, err := ins[other].r.Observe(ctx, "watched", 0)
	if err != nil {
		t.Fatal(err)
	}
	if i := <-seen; !i.Held || i.Holder != leader {
		t.Fatalf("first state: %+v, want %s leading", i, leader)
	}
	logs.Handle(ctx, slog.NewRecord(time.Now(), slog.LevelInfo, "stopping "+leader, 0))
	ins[leader].stop(t)
	logs.Handle(ctx, slog.NewRecord(time.Now(), slog.LevelInfo, "stopped "+leader, 0))
	// 20 s: below the 30 s of a poll, so the news can only have come by
	// notification, with room for a loaded machine (a failure under load
	// took more than 5 s for the leave, the new leader's acquisition and
	// its notification).
	for deadline := time.After(20 * time.Second); ; {
		select {
		case i := <-seen:
			logs.Handle(ctx, slog.NewRecord(time.Now(), slog.LevelInfo, fmt.Sprintf("observed %+v", i), 0))
			if i.Held && i.Holder == other {
				return
			}
		case <-deadline:
			t.Fatalf("no news of %s leading within 20s (polls every 30s)", other)
		}
	}
}

// Observe refuses a job the runner does not run and a shard it lacks.
func TestObserveRefusesUnknownJobs(t *testing.T) {
	db := pgtest.New(t)
	r, err := runner.New(lockClient(t, db.Pool, lock.Config{Schema: db.Schema}), runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Register(runner.Job{Name: "j", Schedule: "@every 1h", Run: func(context.Context, *runner.Run) error { return nil }}); err != nil {
		t.Fatal(err)
	}
	ctx := pgtest.Context(t, time.Minute)
	if _, err := r.Observe(ctx, "nope", 0); !errors.Is(err, runner.ErrUnknownJob) {
		t.Fatalf("Observe of an unknown job: %v", err)
	}
	if _, err := r.Observe(ctx, "j", 1); !errors.Is(err, runner.ErrNoSuchShard) {
		t.Fatalf("Observe of shard 1 of an unsharded job: %v", err)
	}
}

package runner_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// What the runner reports for a slot whose CommitTx committed is what the
// ledger holds: succeeded, once, with its effect once, and no failure event
// nor another attempt, whether the COMMIT's reply was lost on the wire (the
// connection reset right after the server answered) or the job returned an
// error after its CommitTx went through.
func TestCommitTxOutcomeIsTheLedgers(t *testing.T) {
	t.Parallel()
	for _, tc := range []string{"reply lost", "error after CommitTx"} {
		t.Run(tc, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			mustExec(t, db, "CREATE TABLE "+tbl(db, "effects")+" (slot timestamptz PRIMARY KEY, token bigint)")
			pool := db.Pool
			var arm func()
			if tc == "reply lost" {
				link, err := faultproxy.To(db.URL)
				if err != nil {
					t.Fatal(err)
				}
				pool = pgtest.NewPool(t, pgtest.UniqueName("commit"), func(cfg *pgxpool.Config) { link.Route(&cfg.ConnConfig.Config) })
				t.Cleanup(func() { _ = link.Close() })
				var armed atomic.Bool
				link.OnCommit(func() (faultproxy.CommitFault, time.Duration) {
					if armed.Swap(false) {
						return faultproxy.ResetAfterReply, 0
					}
					return faultproxy.CommitPass, 0
				})
				arm = func() { armed.Store(true) }
			}
			var (
				mu    sync.Mutex
				first time.Time // the slot under test: the job's first
				calls int
			)
			job := runner.Job{Name: "charge", Schedule: "@every 200ms", Retry: runner.Retry{MaxAttempts: 3, Backoff: 10 * time.Millisecond},
				Run: func(ctx context.Context, run *runner.Run) error {
					mu.Lock()
					if first.IsZero() {
						first = run.Slot
					}
					mine := run.Slot.Equal(first)
					if mine {
						calls++
					}
					mu.Unlock()
					if mine && arm != nil {
						arm() // this run's COMMIT meets the fault
					}
					err := run.CommitTx(ctx, func(tx pgx.Tx) error {
						_, err := tx.Exec(ctx, "INSERT INTO "+tbl(db, "effects")+" VALUES ($1, $2)", run.Slot, int64(run.Token))
						return err
					})
					if err == nil && mine && tc == "error after CommitTx" {
						return errors.New("an error after the commit")
					}
					return err
				}}
			ev := &events{}
			start(t, pool, lock.Config{Schema: db.Schema}, runner.Config{OnEvent: ev.hook("a")},
				func(r *runner.Runner) error { return r.Register(job) })
			waitFor(t, 20*time.Second, "slots after the first to succeed", func() bool {
				return len(ev.slots(runner.RunSucceeded)) >= 3
			})
			mu.Lock()
			slot, n := first, calls
			mu.Unlock()
			var attempts []string
			rows, err := db.Pool.Query(context.Background(), "SELECT status FROM "+tbl(db, "pgfence_runs")+
				" WHERE job = 'charge' AND slot = $1 ORDER BY attempt", slot)
			if err == nil {
				attempts, err = pgx.CollectRows(rows, pgx.RowTo[string])
			}
			if err != nil {
				t.Fatal(err)
			}
			effects := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "effects")+" WHERE slot = $1", slot)
			if len(attempts) != 1 || attempts[0] != "succeeded" || effects != 1 || n != 1 {
				t.Errorf("the slot's attempts %v, effects %d, job calls %d; want [succeeded], 1, 1", attempts, effects, n)
			}
			ev.mu.Lock()
			defer ev.mu.Unlock()
			succeeded := 0
			for _, e := range ev.all {
				if !e.Slot.Equal(slot) {
					continue
				}
				switch e.Kind {
				case runner.RunSucceeded:
					succeeded++
				case runner.RunFailed, runner.RunFenced:
					t.Errorf("the runner reported %v for a slot whose work committed: %v", e.Kind, e.Err)
				}
			}
			if succeeded != 1 {
				t.Errorf("%d RunSucceeded events for the slot, want 1", succeeded)
			}
		})
	}
}

// RunNow's answer is true when its COMMIT's reply is lost: the request
// committed, so it returns the runs it asked for (a caller told "failed"
// would ask again, and the job would run twice), and the ledger holds
// exactly one request.
func TestRunNowReplyLost(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	link, err := faultproxy.To(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.NewPool(t, pgtest.UniqueName("runnow"), func(cfg *pgxpool.Config) { link.Route(&cfg.ConnConfig.Config) })
	t.Cleanup(func() { _ = link.Close() })
	// A job must be registered for RunNow to know it: an instance that
	// registers it and never leads it long enough to matter.
	mustExec(t, db, "INSERT INTO "+tbl(db, "pgfence_jobs")+" (job, schedule, shards, max_attempts, registered_at, registered_by) "+
		"VALUES ('nightly', '@every 1h', 0, 1, now(), 'test')")
	var armed atomic.Bool
	armed.Store(true)
	link.OnCommit(func() (faultproxy.CommitFault, time.Duration) {
		if armed.Swap(false) {
			return faultproxy.ResetAfterReply, 0
		}
		return faultproxy.CommitPass, 0
	})
	refs, err := runner.RunNow(ctx, pool, db.Schema, "nightly", runner.AllShards, "operator")
	if err != nil || len(refs) != 1 {
		t.Fatalf("RunNow with its COMMIT's reply lost: %v, %v; want the one run it asked for", refs, err)
	}
	if armed.Load() {
		t.Fatal("the fault did not happen")
	}
	if n := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_runs")+" WHERE job = 'nightly' AND kind = 'manual'"); n != 1 {
		t.Fatalf("%d manual runs in the ledger, want 1", n)
	}
}

// runUntilStarted runs a runner of job on client until started is closed
// (the job's function has begun), and returns its cancel and Run's result.
func runUntilStarted(t *testing.T, client *lock.Client, cfg runner.Config, job runner.Job, started <-chan struct{}) (context.CancelFunc, <-chan error) {
	t.Helper()
	r, err := runner.New(client, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Register(job); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the job did not start")
	}
	return cancel, done
}

// Run does not pretend to have stopped cleanly while a job still runs: a
// job that ignores its context past ShutdownTimeout is named in a
// *StopError (its lease released), and nil comes only after a clean stop.
func TestRunNamesJobsThatDidNotStop(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	started, release := make(chan struct{}), make(chan struct{})
	var once, releaseOnce sync.Once
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) }) // the job's goroutine ends, whatever failed
	job := runner.Job{Name: "stubborn", Schedule: "@every 100ms", Run: func(context.Context, *runner.Run) error {
		once.Do(func() { close(started) })
		<-release // ignores its context
		return nil
	}}
	cancel, done := runUntilStarted(t, lockClient(t, db.Pool, lock.Config{Schema: db.Schema}),
		runner.Config{ShutdownTimeout: 200 * time.Millisecond}, job, started)
	cancel()
	var err2 error
	select {
	case err2 = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	releaseOnce.Do(func() { close(release) }) // lets the job's goroutine end, for the leak check
	var se *runner.StopError
	if !errors.As(err2, &se) || !errors.Is(err2, runner.ErrNotStopped) || len(se.Jobs) != 1 || se.Jobs[0] != "stubborn" {
		t.Fatalf("Run with a job that ignores its context: %v; want a StopError naming it", err2)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_leases")+" WHERE holder IS NOT NULL"); n != 0 {
		t.Fatalf("%d leases still held after Run returned", n)
	}
}

// A job whose function returned is not named as one that did not stop,
// even when recording its run, ending its term and releasing its lease do
// not finish within ShutdownTimeout (the database cut off by a partition
// that black-holes packets): what Run says of the jobs is true.
func TestRunDoesNotNameJobsThatStoppedWhenItsDatabaseIsCutOff(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	link, err := faultproxy.To(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.NewPool(t, pgtest.UniqueName("cut-at-stop"), func(cfg *pgxpool.Config) { link.Route(&cfg.ConnConfig.Config) })
	t.Cleanup(func() { _ = link.Close() })
	started, returned := make(chan struct{}), make(chan struct{})
	var once sync.Once
	job := runner.Job{Name: "prompt", Schedule: "@every 100ms", Run: func(ctx context.Context, _ *runner.Run) error {
		once.Do(func() { close(started) })
		<-ctx.Done()
		defer close(returned)
		return nil // finished: its run is recorded as succeeded
	}}
	const shutdown = 2 * time.Second
	cancel, done := runUntilStarted(t, lockClient(t, pool, lock.Config{Schema: db.Schema, TTL: time.Minute}),
		runner.Config{ShutdownTimeout: shutdown}, job, started)
	link.Set(faultproxy.Blackhole)
	cancel()
	stopping := time.Now()
	select {
	case <-returned:
	case <-time.After(30 * time.Second):
		t.Fatal("the job's function did not return")
	}
	var runErr error
	select {
	case runErr = <-done:
	case <-time.After(shutdown + wait.CleanupTimeout + 30*time.Second):
		t.Fatal("Run did not return")
	}
	took := time.Since(stopping)
	if errors.Is(runErr, runner.ErrNotStopped) || !errors.Is(runErr, runner.ErrTermsNotEnded) {
		t.Fatalf("Run, after %v, its job's function returned at once: %v; want ErrTermsNotEnded, and no job named as not stopped", took, runErr)
	}
	if took < shutdown {
		t.Fatalf("Run returned %v after its context ended, before ShutdownTimeout (%v)", took, shutdown)
	}
	if bound := shutdown + wait.CleanupTimeout + wait.PastDeadline; took > bound+2*time.Second {
		t.Fatalf("Run returned %v after its context ended, past ShutdownTimeout + 5.5 s (%v)", took, bound)
	}
}

package runner_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

// chargeJob writes one side-effect row per run, in the same transaction as
// the run's success.
func chargeJob(db *pgtest.DB, name, schedule string) runner.Job {
	return runner.Job{Name: name, Schedule: schedule, Run: func(ctx context.Context, run *runner.Run) error {
		return run.CommitTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+tbl(db, "effects")+" (slot, token) VALUES ($1, $2)", run.Slot, int64(run.Token))
			return err
		})
	}}
}

// Three instances, one interval job: every slot succeeds
// exactly once, and the side effects match the ledger one to one.
func TestEverySlotSucceedsExactlyOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	mustExec(t, db, "CREATE TABLE "+tbl(db, "effects")+" (slot timestamptz, token bigint)")
	const interval = 300 * time.Millisecond
	for i := range 3 {
		start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: fmt.Sprintf("i%d", i), TTL: 3 * time.Second, PollInterval: 100 * time.Millisecond}, runner.Config{}, func(r *runner.Runner) error {
			return r.Register(chargeJob(db, "tick", "@every 300ms"))
		})
	}
	runs := tbl(db, "pgfence_runs")
	waitFor(t, 60*time.Second, "30 succeeded slots", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE status = 'succeeded'") >= 31
	})
	// Consider the first 30 slots from the first one run.
	type slot struct {
		At     time.Time
		Status string
	}
	r, err := db.Pool.Query(context.Background(), "SELECT slot, status FROM "+runs+" WHERE job = 'tick' ORDER BY slot LIMIT 30")
	if err != nil {
		t.Fatal(err)
	}
	slots, err := pgx.CollectRows(r, pgx.RowToStructByPos[slot])
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range slots {
		if s.Status != "succeeded" {
			t.Errorf("slot %v: status %s", s.At, s.Status)
		}
		if i > 0 && s.At.Sub(slots[i-1].At) != interval {
			t.Errorf("gap in slots: %v then %v", slots[i-1].At, s.At)
		}
	}
	first, last := slots[0].At, slots[len(slots)-1].At
	mismatch := queryInt(t, db, `SELECT count(*) FROM (
		SELECT slot, token FROM `+runs+` WHERE status = 'succeeded' AND slot BETWEEN $1 AND $2
		EXCEPT ALL SELECT slot, token FROM `+tbl(db, "effects")+` WHERE slot BETWEEN $1 AND $2) d`, first, last)
	extra := queryInt(t, db, `SELECT count(*) FROM (
		SELECT slot, token FROM `+tbl(db, "effects")+` WHERE slot BETWEEN $1 AND $2
		EXCEPT ALL SELECT slot, token FROM `+runs+` WHERE status = 'succeeded' AND slot BETWEEN $1 AND $2) d`, first, last)
	if mismatch != 0 || extra != 0 {
		t.Fatalf("ledger and side effects differ: %d ledger rows without effect, %d effects without ledger row", mismatch, extra)
	}
}

// The leader is stopped mid-run (its lease revoked while the
// run is stuck); another instance takes over within TTL + one poll interval;
// the old run's later write and its late success are refused; the slot ends
// with exactly one success.
func TestLeaderRevokedMidRun(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	mustExec(t, db, "CREATE TABLE "+tbl(db, "effects")+" (slot timestamptz, token bigint)")
	const ttl, poll = 1500 * time.Millisecond, 200 * time.Millisecond
	var (
		mu         sync.Mutex
		zombieRun  *runner.Run
		stuck      = make(chan struct{})
		wake       = make(chan struct{})
		zombieErrs = make(chan [2]error, 1)
	)
	job := chargeJob(db, "nightly", "@every 2s")
	normal := job.Run
	job.Run = func(ctx context.Context, run *runner.Run) error {
		if run.Attempt > 1 {
			return normal(ctx, run)
		}
		mu.Lock()
		first := zombieRun == nil
		if first {
			zombieRun = run
		}
		mu.Unlock()
		if !first {
			return normal(ctx, run)
		}
		close(stuck)
		<-wake // frozen: ignores its context
		bg := context.Background()
		writeErr := run.RunTx(bg, func(tx pgx.Tx) error {
			_, err := tx.Exec(bg, "INSERT INTO "+tbl(db, "effects")+" VALUES ($1, $2)", run.Slot, int64(run.Token))
			return err
		})
		commitErr := normal(bg, run) // the late success, through CommitTx
		zombieErrs <- [2]error{writeErr, commitErr}
		return commitErr
	}
	ev := &events{}
	var gained sync.Map
	ev.fn = func(who string, e runner.Event) {
		if e.Kind == runner.LeadershipGained {
			gained.Store(who, time.Now())
		}
	}
	for i := range 3 {
		who := fmt.Sprintf("i%d", i)
		start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: who, TTL: ttl, PollInterval: poll}, runner.Config{OnEvent: ev.hook(who)}, func(r *runner.Runner) error { return r.Register(job) })
	}
	select {
	case <-stuck:
	case <-time.After(10 * time.Second):
		t.Fatal("no run started")
	}
	mu.Lock()
	zr := zombieRun
	mu.Unlock()
	leader := holderOf(t, db, "pgfence/job/nightly")
	// Revoke: the lease ends at the database (as if the holder had been
	// frozen past its TTL), and the leader's renewals are refused.
	revoked := time.Now()
	mustExec(t, db, expiry.SQL(db.Schema), "pgfence/job/nightly")
	waitFor(t, 30*time.Second, "the slot to succeed under a new leader", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_runs")+" WHERE slot = $1 AND status = 'succeeded'", zr.Slot) == 1
	})
	var took time.Duration
	gained.Range(func(k, v any) bool {
		if k.(string) != leader && v.(time.Time).After(revoked) {
			took = v.(time.Time).Sub(revoked)
		}
		return true
	})
	if took == 0 || took > ttl+poll {
		t.Fatalf("takeover took %v, want <= TTL + poll = %v", took, ttl+poll)
	}
	close(wake)
	errs := <-zombieErrs
	if !errors.Is(errs[0], lock.ErrLeaseLost) && !errors.Is(errs[0], fence.ErrStaleToken) {
		t.Fatalf("zombie's late write: %v", errs[0])
	}
	// Refused either by the database (a stale token) or, when the zombie's
	// runner already knows its lease ended, before it is sent (the lease's
	// loss): both are fence.ErrFenced.
	if !errors.Is(errs[1], fence.ErrFenced) {
		t.Fatalf("zombie's late success: %v, want fence.ErrFenced", errs[1])
	}
	var attempt int
	var token int64
	if err := db.Pool.QueryRow(context.Background(), "SELECT attempt, token FROM "+tbl(db, "pgfence_runs")+" WHERE slot = $1 AND status = 'succeeded'", zr.Slot).Scan(&attempt, &token); err != nil {
		t.Fatal(err)
	}
	if attempt != 2 || fence.Token(token) <= zr.Token {
		t.Fatalf("slot succeeded with attempt %d token %d; zombie had token %d", attempt, token, zr.Token)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "effects")+" WHERE slot = $1", zr.Slot); n != 1 {
		t.Fatalf("%d effects for the slot, want 1", n)
	}
	// The zombie's refused attempt stays in the ledger, as fenced.
	fenced, err := runner.Runs(context.Background(), db.Pool, db.Schema, runner.RunFilter{Job: "nightly", Status: runner.StatusFenced})
	if err != nil || len(fenced) != 1 || !fenced[0].Slot.Equal(zr.Slot) || fenced[0].Attempt != 1 || fenced[0].Token != zr.Token ||
		fenced[0].Holder != leader {
		t.Fatalf("fenced attempts: %+v, %v; want the zombie's attempt 1 of slot %v with token %d on %s", fenced, err, zr.Slot, zr.Token, leader)
	}
	t.Logf("takeover %v after revocation (TTL %v, poll %v)", took, ttl, poll)
}

// Graceful shutdown of the leader hands the job over within 1s
// (the others poll every 10s, so only the release notification is fast).
func TestGracefulShutdownHandsOver(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	mustExec(t, db, "CREATE TABLE "+tbl(db, "effects")+" (slot timestamptz, token bigint)")
	ev := &events{}
	gainedAt := make(chan string, 10)
	ev.fn = func(who string, e runner.Event) {
		if e.Kind == runner.LeadershipGained {
			gainedAt <- who
		}
	}
	ins := map[string]*instance{}
	app := pgtest.UniqueName("handover")
	pool := pgtest.NewPool(t, app)
	for i := range 3 {
		who := fmt.Sprintf("i%d", i)
		ins[who] = start(t, pool, lock.Config{Schema: db.Schema, Holder: who, TTL: 30 * time.Second, PollInterval: 10 * time.Second}, runner.Config{OnEvent: ev.hook(who)},
			func(r *runner.Runner) error { return r.Register(chargeJob(db, "handover", "@every 1h")) })
	}
	first := <-gainedAt
	// Every instance listens (its balancer watches the membership, which
	// the leader's shutdown changes): the handover is the notification's.
	waitFor(t, 30*time.Second, "the three instances listening", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN pgfence_released'", app) == 3
	})
	stopped := time.Now()
	ins[first].stop(t)
	select {
	case next := <-gainedAt:
		if next == first {
			t.Fatal("the stopped instance led again")
		}
		if d := time.Since(stopped); d > time.Second {
			t.Fatalf("handover took %v", d)
		} else {
			t.Logf("handover took %v", d)
		}
	case <-time.After(time.Second):
		t.Fatal("no handover within 1s of graceful shutdown")
	}
}

// Bad registrations and configs are clear errors.
func TestBadInput(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	if _, err := runner.New(nil, runner.Config{}); !errors.Is(err, runner.ErrNilClient) {
		t.Errorf("nil client: %v", err)
	}
	// The lease settings are the client's: RebalanceInterval is checked
	// against its TTL.
	if _, err := runner.New(lockClient(t, db.Pool, lock.Config{TTL: time.Second}), runner.Config{RebalanceInterval: 2 * time.Second}); err == nil || !strings.Contains(err.Error(), "RebalanceInterval") {
		t.Errorf("rebalance > TTL: %v", err)
	}
	// Every config error names its own field and matches
	// runner.ErrInvalidConfig.
	for _, c := range []struct {
		cfg   runner.Config
		field string
	}{
		{runner.Config{ShutdownTimeout: -1}, "ShutdownTimeout"},
		{runner.Config{RebalanceInterval: -1}, "RebalanceInterval"},
		{runner.Config{RebalanceInterval: time.Minute}, "RebalanceInterval"},
	} {
		_, err := runner.New(lockClient(t, db.Pool, lock.Config{}), c.cfg)
		var ce *runner.ConfigError
		if !errors.As(err, &ce) || ce.Field != c.field || !errors.Is(err, runner.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want a runner.ConfigError for %s", c.cfg, err, c.field)
		}
	}
	r, err := runner.New(lockClient(t, db.Pool, lock.Config{Schema: db.Schema, Logger: quiet}), runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ok := func(context.Context, *runner.Run) error { return nil }
	// Each refusal is a *JobError naming the field, as ConfigError does.
	cases := []struct {
		name  string
		err   error
		want  error
		field string
	}{
		{"bad cron", r.Register(runner.Job{Name: "a", Schedule: "61 * * * *", Run: ok}), runner.ErrInvalidSchedule, "Schedule"},
		{"bad cron tz", r.Register(runner.Job{Name: "a", Schedule: "CRON_TZ=Mars/Olympus 0 2 * * *", Run: ok}), runner.ErrInvalidSchedule, "Schedule"},
		{"bad every", r.Register(runner.Job{Name: "a", Schedule: "@every -5m", Run: ok}), runner.ErrInvalidSchedule, "Schedule"},
		{"every below the floor", r.Register(runner.Job{Name: "a", Schedule: "@every 1ms", Run: ok}), runner.ErrInvalidSchedule, "Schedule"},
		{"empty schedule", r.Register(runner.Job{Name: "a", Run: ok}), runner.ErrInvalidJob, "Schedule"},
		{"nil run", r.Register(runner.Job{Name: "a", Schedule: "@every 1m"}), runner.ErrInvalidJob, "Run"},
		{"no name", r.Register(runner.Job{Schedule: "@every 1m", Run: ok}), runner.ErrInvalidJob, "Name"},
		{"zero shards", r.RegisterSharded(runner.Job{Name: "s", Schedule: "@every 1m", Run: ok}, 0), runner.ErrInvalidJob, "shards"},
		{"negative timeout", r.Register(runner.Job{Name: "a", Schedule: "@every 1m", Run: ok, Timeout: -1}), runner.ErrInvalidJob, "Timeout"},
		{"unknown missed policy", r.Register(runner.Job{Name: "a", Schedule: "@every 1m", Run: ok, Missed: -9}), runner.ErrInvalidJob, "Missed"},
	}
	for _, tc := range cases {
		var je *runner.JobError
		if !errors.Is(tc.err, tc.want) || !errors.As(tc.err, &je) || je.Field != tc.field {
			t.Errorf("%s: err = %v, want %v naming field %s", tc.name, tc.err, tc.want, tc.field)
		}
	}
	if err := r.Register(runner.Job{Name: "dup", Schedule: "CRON_TZ=Europe/Paris 0 2 * * *", Run: ok}); err != nil {
		t.Fatalf("valid cron job: %v", err)
	}
	if err := r.Register(runner.Job{Name: "dup", Schedule: "@every 1m", Run: ok}); !errors.Is(err, runner.ErrDuplicateJob) {
		t.Errorf("duplicate: %v", err)
	}
}

// Retries: a failing attempt is recorded and retried up to MaxAttempts; a
// panic is an ordinary failure.
func TestRetriesAndFailures(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var mu sync.Mutex
	attempts := map[time.Time]int{}
	job := runner.Job{Name: "flaky", Schedule: "@every 500ms", Retry: runner.Retry{MaxAttempts: 3, Backoff: 10 * time.Millisecond},
		Run: func(ctx context.Context, run *runner.Run) error {
			mu.Lock()
			attempts[run.Slot]++
			n := attempts[run.Slot]
			mu.Unlock()
			switch n {
			case 1:
				return errors.New("transient")
			case 2:
				panic("boom")
			}
			return nil
		}}
	ev := &events{}
	start(t, db.Pool, lock.Config{Schema: db.Schema}, runner.Config{OnEvent: ev.hook("a")}, func(r *runner.Runner) error { return r.Register(job) })
	waitFor(t, 10*time.Second, "a slot to succeed on its third attempt", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_runs")+" WHERE status = 'succeeded' AND attempt = 3") >= 1
	})
	if ev.count(runner.RunFailed) < 2 {
		t.Fatalf("RunFailed events = %d", ev.count(runner.RunFailed))
	}
	// Every attempt of that slot is kept, each with its outcome.
	var statuses []string
	rows, err := db.Pool.Query(context.Background(), "SELECT status || ':' || coalesce(error, '') FROM "+tbl(db, "pgfence_runs")+
		" WHERE slot = (SELECT slot FROM "+tbl(db, "pgfence_runs")+" WHERE status = 'succeeded' AND attempt = 3 LIMIT 1) ORDER BY attempt")
	if err == nil {
		statuses, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil || len(statuses) != 3 || statuses[0] != "failed:transient" || !strings.HasPrefix(statuses[1], "panicked:") ||
		!strings.Contains(statuses[1], "boom") || statuses[2] != "succeeded:" {
		t.Fatalf("attempts of the slot: %q, %v; want failed, panicked, succeeded", statuses, err)
	}
}

func holderOf(t testing.TB, db *pgtest.DB, lease string) string {
	t.Helper()
	var h string
	if err := db.Pool.QueryRow(context.Background(), "SELECT coalesce(holder, '') FROM "+tbl(db, "pgfence_leases")+" WHERE name = $1", lease).Scan(&h); err != nil {
		t.Fatal(err)
	}
	return h
}

func mustExec(t testing.TB, db *pgtest.DB, sql string, args ...any) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// Missed slots after downtime, on a fake clock: RunLatest runs the latest
// missed slot once (and none before it), Skip runs none, CatchUp(3) runs the
// latest three oldest first; then each waits for the next slot and runs it
// when the clock reaches it.
func TestMissedSlotPolicy(t *testing.T) {
	t.Parallel()
	latest := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name   string
		policy runner.Missed
		runs   []time.Time
	}{
		{"run-latest", runner.RunLatest, []time.Time{latest}},
		{"skip", runner.Skip, nil},
		{"catch-up", runner.CatchUp(3), []time.Time{latest.Add(-2 * time.Hour), latest.Add(-time.Hour), latest}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			// The job last ran ten hours ago; the replicas were down since.
			mustExec(t, db, "INSERT INTO "+tbl(db, "pgfence_runs")+` (job, shard, kind, slot, attempt, token, status, holder, started_at)
				VALUES ('hourly', 0, 'scheduled', $1, 1, 1, 'succeeded', 'old', $1)`, latest.Add(-10*time.Hour))
			clk := clock.NewFake(latest.Add(30 * time.Minute))
			ev := &events{}
			job := runner.Job{Name: "hourly", Schedule: "@every 1h", Missed: tc.policy,
				Run: func(context.Context, *runner.Run) error { return nil }}
			start(t, db.Pool, lock.Config{Schema: db.Schema}, runner.Config{OnEvent: ev.hook("a")}, func(r *runner.Runner) error {
				r.SetClock(clk)
				return r.Register(job)
			})
			// The leader has run what it catches up and waits for 11:00.
			waitFor(t, 10*time.Second, "the leader to wait for its next slot", func() bool { return clk.Pending() == 1 })
			if got := ev.slots(runner.RunSucceeded); !slices.EqualFunc(got, tc.runs, time.Time.Equal) {
				t.Fatalf("ran slots %v, want %v", got, tc.runs)
			}
			if n := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_runs")+" WHERE job = 'hourly'"); n != 1+len(tc.runs) {
				t.Fatalf("%d ledger rows, want %d", n, 1+len(tc.runs))
			}
			clk.Advance(30 * time.Minute)
			next := latest.Add(time.Hour)
			waitFor(t, 10*time.Second, "the 11:00 slot to run", func() bool {
				got := ev.slots(runner.RunSucceeded)
				return len(got) == len(tc.runs)+1 && got[len(got)-1].Equal(next)
			})
		})
	}
}

// A run that completes while the runner shuts down has its success recorded,
// so the next leader does not run the slot again; one interrupted by the
// shutdown (it returns an error) is left for the next leader.
func TestShutdownRecordsFinishedRuns(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		result func(ctx context.Context) error
		want   string
	}{
		{"finished", func(context.Context) error { return nil }, "succeeded"},
		{"interrupted", func(ctx context.Context) error { return context.Cause(ctx) }, "running"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			started := make(chan struct{}, 1)
			job := runner.Job{Name: "drain", Schedule: "@every 200ms", Run: func(ctx context.Context, run *runner.Run) error {
				select {
				case started <- struct{}{}:
				default:
				}
				<-ctx.Done() // works until told to stop
				return tc.result(ctx)
			}}
			in := start(t, db.Pool, lock.Config{Schema: db.Schema}, runner.Config{}, func(r *runner.Runner) error { return r.Register(job) })
			<-started
			in.stop(t)
			var status string
			if err := db.Pool.QueryRow(context.Background(), "SELECT status FROM "+tbl(db, "pgfence_runs")+" ORDER BY slot LIMIT 1").Scan(&status); err != nil {
				t.Fatal(err)
			}
			if status != tc.want {
				rows, _ := db.Pool.Query(context.Background(), "SELECT slot::text || ' #' || attempt || ' ' || status || ' ' || coalesce(error, '') FROM "+
					tbl(db, "pgfence_runs")+" ORDER BY slot, attempt")
				all, _ := pgx.CollectRows(rows, pgx.RowTo[string])
				t.Fatalf("status after shutdown = %s, want %s; the ledger: %q", status, tc.want, all)
			}
		})
	}
}

// Job.Timeout bounds an attempt: a run that overstays it is cancelled and
// recorded as failed with the deadline error.
func TestJobTimeout(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	job := runner.Job{Name: "slow", Schedule: "@every 300ms", Timeout: 50 * time.Millisecond,
		Run: func(ctx context.Context, run *runner.Run) error {
			<-ctx.Done()
			return ctx.Err()
		}}
	start(t, db.Pool, lock.Config{Schema: db.Schema}, runner.Config{}, func(r *runner.Runner) error { return r.Register(job) })
	waitFor(t, 10*time.Second, "a failed run", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "pgfence_runs")+" WHERE status = 'failed' AND error LIKE '%deadline exceeded%'") >= 1
	})
}

// A runner on a schema that is missing, or whose job table is
// gone, returns the error instead of running nothing until it is stopped
// (formerly, Run logged a warning every poll and returned nil).
func TestRunEndsOnPermanentErrors(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	ok := func(context.Context, *runner.Run) error { return nil }

	missing := pgtest.Schema(t, "nojobs")
	r, err := runner.New(lockClient(t, db.Pool, lock.Config{Schema: missing, Logger: quiet, PollInterval: 10 * time.Millisecond}), runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Register(runner.Job{Name: "j", Schedule: "@every 1s", Run: ok}); err != nil {
		t.Fatal(err)
	}
	if err := r.Run(ctx); !errors.Is(err, migrations.ErrNotMigrated) {
		t.Fatalf("Run on a missing schema: %v, want ErrNotMigrated", err)
	}

	// The schema is migrated, but the ledger has been dropped since.
	if _, err := db.Pool.Exec(ctx, "DROP TABLE "+tbl(db, "pgfence_runs")); err != nil {
		t.Fatal(err)
	}
	r, err = runner.New(lockClient(t, db.Pool, lock.Config{Schema: db.Schema, Logger: quiet, PollInterval: 10 * time.Millisecond}), runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Register(runner.Job{Name: "j", Schedule: "@every 100ms", Run: ok}); err != nil {
		t.Fatal(err)
	}
	err = r.Run(ctx)
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || pg.Code != "42P01" || ctx.Err() != nil {
		t.Fatalf("Run without its ledger: %v, want SQLSTATE 42P01 before the test's deadline", err)
	}
}

// On a job's very first start (no slot of it in the ledger), no Missed
// policy runs a past slot, not even the one that fell due just before the
// start: the first run is the job's next slot (on a fake clock).
func TestFirstStartRunsTheNextSlot(t *testing.T) {
	t.Parallel()
	for _, policy := range []runner.Missed{runner.RunLatest, runner.Skip, runner.CatchUp(5)} {
		t.Run(policy.String(), func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ev := &events{}
			job := runner.Job{Name: "fresh", Schedule: "@every 1m", Missed: policy,
				Run: func(context.Context, *runner.Run) error { return nil }}
			began := time.Date(2026, 12, 1, 10, 0, 0, 1e6, time.UTC) // 1 ms after a slot
			clk := clock.NewFake(began)
			start(t, db.Pool, lock.Config{Schema: db.Schema}, runner.Config{OnEvent: ev.hook("a")}, func(r *runner.Runner) error {
				r.SetClock(clk)
				return r.Register(job)
			})
			waitFor(t, 10*time.Second, "the leader to wait for its first slot", func() bool { return clk.Pending() == 1 })
			if got := ev.slots(runner.RunStarted); len(got) != 0 {
				t.Fatalf("ran %v before its first slot", got)
			}
			clk.Advance(time.Minute)
			waitFor(t, 10*time.Second, "the first slot to run", func() bool { return len(ev.slots(runner.RunSucceeded)) == 1 })
			if got := ev.slots(runner.RunStarted)[0]; !got.Equal(began.Truncate(time.Minute).Add(time.Minute)) {
				t.Fatalf("the first run was for slot %v, want the next one after %v", got, began)
			}
		})
	}
}

// A service stopped while it starts (its context cancelled before or while
// Run checks the schema) gets nil from Run, as from any clean stop, not the
// cancellation dressed up as a migration error.
func TestRunWithACancelledContextReturnsNil(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	r, err := runner.New(lockClient(t, db.Pool, lock.Config{Schema: db.Schema, Logger: quiet}), runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Register(runner.Job{Name: "j", Schedule: "@every 1s", Run: func(context.Context, *runner.Run) error { return nil }}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.Run(ctx); err != nil {
		t.Fatalf("Run with a cancelled context: %v, want nil", err)
	}
}

// One token type; 10.8: runner.ErrFenced is fenced.
func TestEventTokenType(t *testing.T) {
	var tok fence.Token = runner.Event{Token: 3}.Token
	if tok != 3 || !errors.Is(runner.ErrFenced, fence.ErrFenced) {
		t.Fatal("runner.Event.Token is a fence.Token and runner.ErrFenced matches fence.ErrFenced")
	}
}

// The ledger has a read API, and rows that are not
// needed go away: Prune deletes old finished runs but keeps each job's
// latest slot and anything running; heartbeats delete instance rows dead
// for an hour.
func TestLedgerReadAndPrune(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	runs := tbl(db, "pgfence_runs")
	old := time.Now().Add(-48 * time.Hour)
	mustExec(t, db, "INSERT INTO "+runs+` (job, shard, kind, slot, attempt, token, status, holder, started_at, finished_at, error) VALUES
		('a', 0, 'scheduled', $1, 1, 1, 'succeeded', 'h', $1, $1, NULL),
		('a', 0, 'scheduled', $1::timestamptz + interval '1 hour', 1, 2, 'failed', 'h', $1::timestamptz + interval '1 hour', $1::timestamptz + interval '1 hour', 'boom'),
		('a', 0, 'manual', $1::timestamptz + interval '3 hours', 1, 3, 'succeeded', 'h', $1::timestamptz + interval '3 hours', $1::timestamptz + interval '3 hours', NULL),
		('a', 0, 'scheduled', $1::timestamptz + interval '2 hours', 1, 3, 'failed', 'h', $1::timestamptz + interval '2 hours', $1::timestamptz + interval '2 hours', 'again'),
		('a', 0, 'scheduled', $1::timestamptz + interval '2 hours', 2, 3, 'succeeded', 'h', $1::timestamptz + interval '2 hours', $1::timestamptz + interval '2 hours', NULL),
		('b', 1, 'scheduled', $1, 1, 4, 'running', 'h', $1, NULL, NULL),
		('b', 1, 'scheduled', now(), 1, 5, 'succeeded', 'h', now(), now(), NULL)`, old)

	all, err := runner.Runs(ctx, db.Pool, db.Schema, runner.RunFilter{})
	if err != nil || len(all) != 7 || all[0].Job != "b" || all[0].Token != 5 {
		t.Fatalf("Runs: %d runs, first %+v, %v", len(all), all[0], err)
	}
	failed, err := runner.Runs(ctx, db.Pool, db.Schema, runner.RunFilter{Job: "a", Status: runner.StatusFailed})
	if err != nil || len(failed) != 2 || failed[0].Error != "again" || failed[0].FinishedAt == nil || failed[1].Error != "boom" {
		t.Fatalf("failed attempts of a (each attempt kept): %+v, %v", failed, err)
	}
	manual, err := runner.Runs(ctx, db.Pool, db.Schema, runner.RunFilter{Job: "a", Kind: runner.KindManual})
	if err != nil || len(manual) != 1 || manual[0].Token != 3 || manual[0].Kind != runner.KindManual {
		t.Fatalf("manual runs of a: %+v, %v", manual, err)
	}
	// Pages of two, newest first, cover a's five attempts once each.
	var paged []string
	for off := 0; off < 6; off += 2 {
		page, err := runner.Runs(ctx, db.Pool, db.Schema, runner.RunFilter{Job: "a", Limit: 2, Offset: off})
		if err != nil {
			t.Fatal(err)
		}
		for _, ri := range page {
			paged = append(paged, fmt.Sprintf("%d/%s/%d", ri.Token, ri.Kind, ri.Attempt))
		}
	}
	if want := []string{"3/manual/1", "3/scheduled/2", "3/scheduled/1", "2/scheduled/1", "1/scheduled/1"}; !slices.Equal(paged, want) {
		t.Fatalf("a's attempts in pages of two: %v, want %v", paged, want)
	}
	if _, err := runner.Runs(ctx, db.Pool, db.Schema, runner.RunFilter{Offset: -1}); err == nil {
		t.Fatal("Runs with a negative offset: no error")
	}
	// a's terms: token 3's three attempts (one still failing, then its
	// retry, and the manual run), 2's, 1's; b's are left out.
	terms, err := runner.Terms(ctx, db.Pool, db.Schema, runner.TermFilter{Job: "a"})
	if err != nil || len(terms) != 3 || terms[0].Token != 3 || terms[0].Attempts != 3 || terms[2].Token != 1 ||
		terms[0].Until.Sub(old.Add(3*time.Hour)).Abs() > time.Microsecond || terms[0].Fenced != 0 {
		t.Fatalf("terms of a: %+v, %v", terms, err)
	}
	n, err := runner.Prune(ctx, db.Pool, db.Schema, time.Now().Add(-24*time.Hour))
	if err != nil || n != 3 {
		t.Fatalf("Prune deleted %d, %v; want the two older scheduled slots of a and its old manual run", n, err)
	}
	left, err := runner.Runs(ctx, db.Pool, db.Schema, runner.RunFilter{Limit: 100})
	if err != nil || len(left) != 4 {
		t.Fatalf("after Prune: %d runs, %v; want both attempts of a's latest slot, b's running and recent runs", len(left), err)
	}
	mustExec(t, db, "INSERT INTO "+runs+` (job, shard, kind, slot, attempt, token, status, holder, started_at, finished_at, error) VALUES
		('c', 0, 'scheduled', now(), 1, 7, 'fenced', 'h', now(), now(), 'stale'),
		('c', 0, 'scheduled', now(), 2, 8, 'succeeded', 'h2', now(), now(), NULL)`)
	if terms, err := runner.Terms(ctx, db.Pool, db.Schema, runner.TermFilter{Job: "c"}); err != nil || len(terms) != 2 ||
		terms[0].Fenced+terms[1].Fenced != 1 {
		t.Fatalf("terms of c: %+v, %v; want two, one fenced attempt between them", terms, err)
	}

	inst := tbl(db, "pgfence_instances")
	mustExec(t, db, "INSERT INTO "+inst+` (id, started_at, heartbeat_at, expires_at) VALUES
		('long-dead', now() - interval '3 hours', now() - interval '2 hours', now() - interval '2 hours'),
		('just-dead', now() - interval '3 minutes', now() - interval '2 minutes', now() - interval '1 minute')`)
	in := start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "alive"}, runner.Config{RebalanceInterval: 100 * time.Millisecond},
		func(r *runner.Runner) error {
			return r.RegisterSharded(runner.Job{Name: "s", Schedule: "@every 1h", Run: func(context.Context, *runner.Run) error { return nil }}, 1)
		})
	waitFor(t, 10*time.Second, "the heartbeat to delete the long-dead instance row", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+inst+" WHERE id = 'long-dead'") == 0
	})
	if queryInt(t, db, "SELECT count(*) FROM "+inst+" WHERE id IN ('just-dead', 'alive')") != 2 {
		t.Fatal("the heartbeat deleted a recent row too")
	}
	in.stop(t)
}

// Failures are visible in the log: a failed run at ERROR, a
// fenced one at WARN, with job, shard, slot, attempt and token.
func TestFailuresAreLogged(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	rec := pgtest.NewLogs()
	job := runner.Job{Name: "flaky", Schedule: "@every 100ms", Run: func(ctx context.Context, run *runner.Run) error {
		return errors.New("disk full")
	}}
	in := start(t, db.Pool, lock.Config{Schema: db.Schema, Logger: slog.New(rec)}, runner.Config{},
		func(r *runner.Runner) error { return r.Register(job) })
	waitFor(t, 10*time.Second, "a failed run to be logged", func() bool { return len(rec.Find(slog.LevelError, "run failed")) > 0 })
	in.stop(t)
	r := rec.Find(slog.LevelError, "run failed")[0]
	attrs := map[string]string{}
	r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
	for _, k := range []string{"job", "shard", "slot", "attempt", "token", "err"} {
		if attrs[k] == "" {
			t.Errorf("the failed-run record has no %q: %v", k, attrs)
		}
	}
	if attrs["job"] != "flaky" || !strings.Contains(attrs["err"], "disk full") {
		t.Errorf("the failed-run record: %v", attrs)
	}
}

// The runner leads its jobs with the application's own lock client: one
// process, one listener connection, however many jobs wait and whatever
// the application waits for itself; and the client outlives the runner.
func TestRunnerSharesTheApplicationsClient(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	app := pgtest.UniqueName("shared")
	pool := pgtest.NewPool(t, app)
	client := lockClient(t, pool, lock.Config{Schema: db.Schema, TTL: 2 * time.Second})
	other := lockClient(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "other"})
	if _, err := other.TryAcquire(ctx, "held-elsewhere"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"j1", "j2"} { // another replica leads both jobs
		if _, err := other.TryAcquire(ctx, "pgfence/job/"+name); err != nil {
			t.Fatal(err)
		}
	}
	r, err := runner.New(client, runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"j1", "j2"} {
		if err := r.Register(runner.Job{Name: name, Schedule: "@every 1s", Run: func(context.Context, *runner.Run) error { return nil }}); err != nil {
			t.Fatal(err)
		}
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	waited := make(chan error, 1)
	actx, cancelWait := context.WithCancel(ctx)
	go func() { _, err := client.Acquire(actx, "held-elsewhere"); waited <- err }() // the application waits too
	listeners := func() int {
		return queryInt(t, db, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'", app)
	}
	waitFor(t, 10*time.Second, "a listener for the waiting acquisitions", func() bool { return listeners() >= 1 })
	time.Sleep(300 * time.Millisecond) // a second listener, if there were one, would be up by now
	if n := listeners(); n != 1 {
		t.Fatalf("%d LISTEN connections for the application and its runner; want 1", n)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	cancelWait()
	<-waited
	if _, err := client.TryAcquire(ctx, "after-the-runner"); err != nil {
		t.Fatalf("the client after Run returned: %v", err)
	}
}

// Health is nil while the runner works, reports heartbeats that stopped
// succeeding for a TTL (the instances table locked by another session),
// recovers, and says "not running" once Run has returned.
func TestRunnerHealth(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	in := start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a", TTL: 3 * time.Second}, runner.Config{RebalanceInterval: 200 * time.Millisecond},
		func(r *runner.Runner) error {
			return r.Register(runner.Job{Name: "tick", Schedule: "@every 1h", Run: func(context.Context, *runner.Run) error { return nil }})
		})
	waitFor(t, 10*time.Second, "the runner to be healthy", func() bool { return in.r.Health(ctx) == nil })

	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "LOCK TABLE "+tbl(db, "pgfence_instances")+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	// Health may report something else first (the lock client's renewals
	// late on a loaded machine): wait for the heartbeats' report.
	var unhealthy error
	waitFor(t, 20*time.Second, "Health to report the heartbeats", func() bool {
		unhealthy = in.r.Health(ctx)
		return unhealthy != nil && strings.Contains(unhealthy.Error(), "no heartbeat")
	})
	if !errors.Is(unhealthy, lock.ErrUnhealthy) {
		t.Fatalf("Health while heartbeats are held up: %v", unhealthy)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "Health to recover", func() bool { return in.r.Health(ctx) == nil })
	in.stop(t)
	if err := in.r.Health(ctx); !errors.Is(err, lock.ErrUnhealthy) || !strings.Contains(err.Error(), "not running") {
		t.Fatalf("Health once Run has returned: %v", err)
	}
}

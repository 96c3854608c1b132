package runner_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// counterGroup is a group whose every partition appends rows (partition, n)
// for n = offset+1 up to target, one per Commit, in the same transaction
// as its offset.
func counterGroup(db *pgtest.DB, name string, partitions int, target *atomic.Int64, poll time.Duration) runner.Consumer {
	return waitingCounterGroup(db, name, partitions, target, poll, nil)
}

// waitingCounterGroup is counterGroup that also calls waiting(partition) as
// a partition's leader calls Wait.
func waitingCounterGroup(db *pgtest.DB, name string, partitions int, target *atomic.Int64, poll time.Duration, waiting func(int)) runner.Consumer {
	effects := tbl(db, "effects")
	return runner.Consumer{
		Group:      name,
		Partitions: partitions,
		Poll:       poll,
		Consume: func(ctx context.Context, p *runner.Partition) error {
			for ctx.Err() == nil {
				if p.Offset() >= target.Load() {
					if waiting != nil {
						waiting(p.Index)
					}
					if err := p.Wait(ctx); err != nil {
						return nil
					}
					continue
				}
				err := p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
					next := p.Offset() + 1
					_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (partition, n, token) VALUES ($1, $2, $3)", p.Index, next, int64(p.Token))
					return next, err
				})
				if err != nil && ctx.Err() == nil {
					return err
				}
			}
			return nil
		},
	}
}

func createEffects(t *testing.T, db *pgtest.DB) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), "CREATE TABLE "+tbl(db, "effects")+
		" (partition int NOT NULL, n bigint NOT NULL, token bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
}

// checkEffects fails unless every partition holds exactly the rows 1..want
// (no duplicate, no gap) and its offset is want.
func checkEffects(t *testing.T, db *pgtest.DB, group string, partitions int, want int64) {
	t.Helper()
	for p := range partitions {
		var n, distinct, maxN int64
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*), count(DISTINCT n), coalesce(max(n), 0) FROM "+
			tbl(db, "effects")+" WHERE partition = $1", p).Scan(&n, &distinct, &maxN); err != nil {
			t.Fatal(err)
		}
		if n != want || distinct != want || maxN != want {
			t.Errorf("partition %d: %d rows, %d distinct, max %d; want exactly 1..%d", p, n, distinct, maxN, want)
		}
	}
	infos, err := runner.Partitions(context.Background(), db.Pool, db.Schema, group)
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) != partitions {
		t.Fatalf("Partitions lists %d partitions, want %d", len(infos), partitions)
	}
	for _, in := range infos {
		if in.Offset != want || in.Commits != want {
			t.Errorf("partition %d: offset %d after %d commits, want %d", in.Partition, in.Offset, in.Commits, want)
		}
	}
}

// A group's partitions are spread over the replicas; each leader commits
// its effects with its offset; when a replica stops, its partitions move
// to the other, which resumes exactly after the last committed offset:
// every effect exactly once.
func TestGroupPartitionsSpreadAndResume(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	var target atomic.Int64
	target.Store(5)
	const parts = 6
	cfg := func(who string) (lock.Config, runner.Config) {
		return lock.Config{Schema: db.Schema, Holder: who, TTL: 2 * time.Second, PollInterval: 200 * time.Millisecond},
			runner.Config{RebalanceInterval: 500 * time.Millisecond}
	}
	reg := func(r *runner.Runner) error {
		return r.RegisterConsumer(counterGroup(db, "relay", parts, &target, 50*time.Millisecond))
	}
	a := startWith(t, db.Pool, "a", cfg, reg)
	startWith(t, db.Pool, "b", cfg, reg)
	offsets := func() (sum int64, leaders map[string]int) {
		infos, err := runner.Partitions(context.Background(), db.Pool, db.Schema, "relay")
		if err != nil {
			t.Fatal(err)
		}
		leaders = map[string]int{}
		for _, in := range infos {
			sum += in.Offset
			if in.Leading {
				leaders[in.Leader]++
			}
		}
		return sum, leaders
	}
	waitFor(t, 60*time.Second, "both replicas leading and every partition at 5", func() bool {
		sum, leaders := offsets()
		return sum == 5*parts && leaders["a"] > 0 && leaders["b"] > 0 && leaders["a"]+leaders["b"] == parts
	})
	a.stop(t)
	target.Store(10)
	for p := range parts {
		if err := runner.Wake(context.Background(), db.Pool, db.Schema, "relay", p); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 60*time.Second, "b leading every partition, each at 10", func() bool {
		sum, leaders := offsets()
		return sum == 10*parts && leaders["b"] == parts
	})
	checkEffects(t, db, "relay", parts, 10)
}

// A partition leader whose lease has passed to another holder cannot
// commit an effect or a offset: the database refuses its token, and
// nothing of its transaction commits.
func TestStalePartitionLeaderIsRefused(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	effects := tbl(db, "effects")
	captured := make(chan *runner.Partition, 1)
	proceed := make(chan struct{})
	result := make(chan error, 1)
	lead := func(ctx context.Context, p *runner.Partition) error {
		select {
		case captured <- p:
		default:
			<-ctx.Done() // later terms do nothing
			return nil
		}
		<-proceed // frozen: it ignores its context meanwhile
		result <- p.Commit(context.Background(), func(ctx context.Context, tx pgx.Tx) (int64, error) {
			_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (partition, n, token) VALUES ($1, 1, $2)", p.Index, int64(p.Token))
			return 1, err
		})
		return nil
	}
	// A long TTL: the stale leader still trusts its lease when it commits
	// (the next renewal is 10 s away), so the database must refuse it.
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "zombie", TTL: 30 * time.Second}, runner.Config{},
		func(r *runner.Runner) error {
			return r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 1, Consume: lead})
		})
	p := <-captured
	ctx := context.Background()
	name := "pgfence/group/relay/0"
	if _, err := lock.ForceRelease(ctx, db.Pool, db.Schema, name); err != nil {
		t.Fatal(err)
	}
	thief := lockClient(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "new-leader"})
	l, err := thief.TryAcquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if l.Token() <= p.Token {
		t.Fatalf("new token %v is not above the stale leader's %v", l.Token(), p.Token)
	}
	close(proceed)
	err = <-result
	if !errors.Is(err, fence.ErrFenced) {
		t.Fatalf("the stale leader's Commit: %v, want an error matching fence.ErrFenced", err)
	}
	t.Logf("stale leader refused: %v", err)
	if n := queryInt(t, db, "SELECT count(*) FROM "+effects); n != 0 {
		t.Fatalf("%d effects of the stale leader committed", n)
	}
	infos, err := runner.Partitions(ctx, db.Pool, db.Schema, "relay")
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) != 1 || infos[0].Offset != 0 || infos[0].Commits != 0 {
		t.Fatalf("partitions after the refusal: %+v, want offset 0, no commit", infos)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A partition that is handed over (here at shutdown; a rebalance takes the
// same path) is handed over after the transaction in flight, not in the
// middle of it: the transaction commits, and only then is the lease
// released.
func TestPartitionHandedOverAfterItsTransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	effects := tbl(db, "effects")
	inTx := make(chan struct{})
	finish := make(chan struct{})
	result := make(chan error, 1)
	lead := func(ctx context.Context, p *runner.Partition) error {
		if p.Offset() > 0 {
			<-ctx.Done()
			return nil
		}
		result <- p.Commit(ctx, func(tctx context.Context, tx pgx.Tx) (int64, error) {
			if _, err := tx.Exec(tctx, "INSERT INTO "+effects+" (partition, n, token) VALUES ($1, 1, $2)", p.Index, int64(p.Token)); err != nil {
				return 0, err
			}
			close(inTx)
			<-finish
			// The lead context has ended meanwhile; the transaction's has not.
			if ctx.Err() == nil {
				return 0, errors.New("the lead context did not end at shutdown")
			}
			_, err := tx.Exec(tctx, "SELECT 1")
			return 1, err
		})
		<-ctx.Done()
		return nil
	}
	in := start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a"}, runner.Config{ShutdownTimeout: time.Minute},
		func(r *runner.Runner) error {
			return r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 1, Consume: lead})
		})
	<-inTx
	in.cancel() // shutdown begins while the transaction is open
	info, err := lock.Inspect(context.Background(), db.Pool, db.Schema, "pgfence/group/relay/0")
	if err != nil || !info.Held || info.Holder != "a" {
		t.Fatalf("the lease during the open transaction: %+v, %v; want it still held by a", info, err)
	}
	close(finish)
	if err := <-result; err != nil {
		t.Fatalf("Commit of the transaction open at shutdown: %v", err)
	}
	in.stop(t)
	checkEffects(t, db, "relay", 1, 1)
}

// Wake reaches the partition's leader at once: with a Poll of an hour, the
// work is found only because of the wake-up.
func TestWakeReachesThePartitionLeader(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	var (
		target  atomic.Int64
		waiting [2]atomic.Bool
	)
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a"}, runner.Config{},
		func(r *runner.Runner) error {
			return r.RegisterConsumer(waitingCounterGroup(db, "relay", 2, &target, time.Hour, func(p int) { waiting[p].Store(true) }))
		})
	// Both partitions led, and both leaders waiting (a leader that had not
	// reached Wait yet would see the new target without a wake-up).
	waitFor(t, 30*time.Second, "both partitions led and waiting", func() bool {
		infos, err := runner.Partitions(context.Background(), db.Pool, db.Schema, "relay")
		return err == nil && len(infos) == 2 && infos[0].Leading && infos[1].Leading &&
			waiting[0].Load() && waiting[1].Load()
	})
	target.Store(1)
	// Wake partition 1 only, in the transaction that "adds the work".
	tx, err := db.Pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := runner.Wake(context.Background(), tx, db.Schema, "relay", 1); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "partition 1 woken", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "effects")+" WHERE partition = 1") == 1
	})
	// The partition not woken still waits (negative control of the wake).
	if n := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "effects")+" WHERE partition = 0"); n != 0 {
		t.Fatalf("partition 0 ran %d times without a wake-up", n)
	}
}

// RegisterConsumer refuses bad groups with a *JobError naming the field, and a
// name taken by a job.
func TestRegisterConsumerRefusesBadConsumers(t *testing.T) {
	db := pgtest.New(t)
	r, err := runner.New(lockClient(t, db.Pool, lock.Config{Schema: db.Schema}), runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	lead := func(context.Context, *runner.Partition) error { return nil }
	for _, tc := range []struct {
		group runner.Consumer
		field string
	}{
		{runner.Consumer{Group: "r", Partitions: 0, Consume: lead}, "Partitions"},
		{runner.Consumer{Group: "r", Partitions: 1 << 17, Consume: lead}, "Partitions"},
		{runner.Consumer{Group: "r", Partitions: 1}, "Consume"},
		{runner.Consumer{Group: "", Partitions: 1, Consume: lead}, "Group"},
		{runner.Consumer{Group: "r", Partitions: 1, Consume: lead, Poll: -time.Second}, "Poll"},
	} {
		err := r.RegisterConsumer(tc.group)
		var je *runner.JobError
		if !errors.As(err, &je) || je.Field != tc.field || !errors.Is(err, runner.ErrInvalidJob) {
			t.Errorf("RegisterConsumer(%+v): %v, want a JobError on %s", tc.group, err, tc.field)
		}
	}
	if err := r.Register(chargeJob(db, "taken", "@every 1h")); err != nil {
		t.Fatal(err)
	}
	if err := r.RegisterConsumer(runner.Consumer{Group: "taken", Partitions: 2, Consume: lead}); !errors.Is(err, runner.ErrDuplicateJob) {
		t.Fatalf("a group named as a job: %v, want ErrDuplicateJob", err)
	}
	if err := runner.Wake(context.Background(), db.Pool, db.Schema, "r", -1); !errors.Is(err, runner.ErrNoSuchShard) {
		t.Fatalf("Wake of partition -1: %v", err)
	}
}

// Commit advances a offset only from the value the term knows: when the
// stored offset has moved (here set by hand, as an earlier commit whose
// answer was lost would have moved it), Commit is refused with
// ErrOffsetMoved, nothing of its transaction commits, and Offset is the
// stored one.
func TestCommitRefusesAMovedOffset(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	effects := tbl(db, "effects")
	moved := make(chan struct{})
	result := make(chan error, 1)
	offset := make(chan int64, 1)
	lead := func(ctx context.Context, p *runner.Partition) error {
		if p.Offset() != 0 {
			<-ctx.Done()
			return nil
		}
		<-moved
		err := p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (partition, n, token) VALUES (0, 1, $1)", int64(p.Token))
			return 1, err
		})
		result <- err
		offset <- p.Offset()
		<-ctx.Done()
		return nil
	}
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a"}, runner.Config{},
		func(r *runner.Runner) error {
			return r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 1, Consume: lead})
		})
	waitFor(t, 30*time.Second, "the partition led", func() bool {
		infos, err := runner.Partitions(context.Background(), db.Pool, db.Schema, "relay")
		return err == nil && len(infos) == 1 && infos[0].Leading
	})
	if _, err := db.Pool.Exec(context.Background(), "UPDATE "+tbl(db, "pgfence_offsets")+" SET committed_offset = 5"); err != nil {
		t.Fatal(err)
	}
	close(moved)
	if err := <-result; !errors.Is(err, runner.ErrOffsetMoved) {
		t.Fatalf("Commit over a moved offset: %v, want ErrOffsetMoved", err)
	}
	if p := <-offset; p != 5 {
		t.Fatalf("Offset after the refusal: %d, want the stored 5", p)
	}
	if n := queryInt(t, db, "SELECT count(*) FROM "+effects); n != 0 {
		t.Fatalf("%d effects of the refused Commit committed", n)
	}
}

// A replica that gives a group another partition count than the one
// registered does not start: Run returns a *PartitionCountError at once,
// logged as an ERROR, and the replicas that agree keep a leader for every
// partition (before the count was in the schema, a replica with 4 of 8 was
// handed partitions 4-7 it never took, and they stayed without a leader).
func TestPartitionCountMismatchRefused(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	var target atomic.Int64
	const ttl, poll = time.Second, 50 * time.Millisecond
	lcfg := func(who string) lock.Config {
		return lock.Config{Schema: db.Schema, Holder: who, TTL: ttl, PollInterval: poll, Logger: pgtest.Quiet}
	}
	rcfg := runner.Config{RebalanceInterval: 200 * time.Millisecond}
	for _, who := range []string{"a", "b"} {
		start(t, db.Pool, lcfg(who), rcfg, func(r *runner.Runner) error {
			return r.RegisterConsumer(counterGroup(db, "relay", 8, &target, poll))
		})
	}
	ctx := pgtest.Context(t, time.Minute)
	allLed := func() bool {
		infos, err := runner.Partitions(ctx, db.Pool, db.Schema, "relay")
		if err != nil {
			t.Fatal(err)
		}
		led := 0
		for _, in := range infos {
			if in.Leading {
				led++
			}
		}
		return led == 8
	}
	waitFor(t, 30*time.Second, "a leader for each of the 8 partitions", allLed)

	logs := pgtest.NewLogs()
	cfg := lcfg("c")
	cfg.Logger = slog.New(logs)
	r, err := runner.New(lockClient(t, db.Pool, cfg), rcfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.RegisterConsumer(counterGroup(db, "relay", 4, &target, poll)); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	began := time.Now()
	err = r.Run(rctx)
	var pc *runner.PartitionCountError
	if !errors.As(err, &pc) || !errors.Is(err, runner.ErrPartitionCount) || pc.Registered != 8 || pc.Given != 4 || pc.Group != "relay" {
		t.Fatalf("Run with 4 partitions of a group registered with 8: %v (after %v), want a *PartitionCountError 8/4", err, time.Since(began))
	}
	t.Logf("refused after %v: %v", time.Since(began).Round(time.Millisecond), err)
	if len(logs.Find(slog.LevelError, "partition count")) == 0 {
		logs.LogOnFailure(t)
		t.Errorf("no ERROR line about the partition count in the refused replica's log")
	}
	// After the refusal every partition keeps a leader. A moment without
	// one is allowed: a hand-over between a and b, or a lease a late
	// renewal lost on a loaded machine, taken again within a TTL. A
	// replica that took 4 of 8 left partitions 4-7 without one for good.
	const gap = ttl + 2*time.Second
	lastLed := time.Now()
	for end := time.Now().Add(2*gap + time.Second); time.Now().Before(end); time.Sleep(poll) {
		if allLed() {
			lastLed = time.Now()
		} else if time.Since(lastLed) > gap {
			t.Fatalf("a partition has had no leader for %v after a replica with another count was refused", time.Since(lastLed).Round(time.Millisecond))
		}
	}
}

// SetPartitions with no replica running: the change waits for the
// replicas (another is refused, asking for the count before cancels it, a
// seek is refused meanwhile); a replica with the new count starts, drains
// to the cut and switches the count; then one with the old count is
// refused.
func TestSetPartitionsWithNoReplicaRunning(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	var target atomic.Int64
	const poll = 50 * time.Millisecond
	lcfg := func(who string) lock.Config {
		return lock.Config{Schema: db.Schema, Holder: who, TTL: time.Second, PollInterval: poll}
	}
	rcfg := runner.Config{RebalanceInterval: 200 * time.Millisecond}
	ctx := pgtest.Context(t, time.Minute)
	led := func(n int) func() bool {
		return func() bool {
			infos, err := runner.Partitions(ctx, db.Pool, db.Schema, "relay")
			if err != nil {
				t.Fatal(err)
			}
			count := 0
			for _, in := range infos {
				if in.Leading && in.Partition < n {
					count++
				}
			}
			return count == n
		}
	}
	if _, err := runner.SetPartitions(ctx, db.Pool, db.Schema, "relay", 4, "op"); !errors.Is(err, runner.ErrUnknownJob) {
		t.Fatalf("SetPartitions of a group never registered: %v, want ErrUnknownJob", err)
	}
	a := start(t, db.Pool, lcfg("a"), rcfg, func(r *runner.Runner) error {
		return r.RegisterConsumer(counterGroup(db, "relay", 8, &target, poll))
	})
	waitFor(t, 30*time.Second, "a leader for each of the 8 partitions", led(8))
	a.stop(t)
	next := func() int {
		gs, err := runner.Groups(ctx, db.Pool, db.Schema, "relay")
		if err != nil || len(gs) != 1 {
			t.Fatalf("Groups: %+v, %v", gs, err)
		}
		return gs[0].Next
	}
	before, err := runner.SetPartitions(ctx, db.Pool, db.Schema, "relay", 4, "op")
	if err != nil || before != 8 || next() != 4 {
		t.Fatalf("SetPartitions with no replica running: %d, %v, next %d; want 8, nil, a change to 4 under way", before, err, next())
	}
	if _, err := runner.SetPartitions(ctx, db.Pool, db.Schema, "relay", 6, "op"); !errors.Is(err, runner.ErrGroupChanging) {
		t.Fatalf("another change while one is under way: %v, want ErrGroupChanging", err)
	}
	if _, err := runner.Seek(ctx, db.Pool, db.Schema, "relay", 0, 0, "op"); !errors.Is(err, runner.ErrGroupChanging) {
		t.Fatalf("a seek while the count changes: %v, want ErrGroupChanging", err)
	}
	// Asking for the count before cancels the change.
	if before, err := runner.SetPartitions(ctx, db.Pool, db.Schema, "relay", 8, "op"); err != nil || before != 8 || next() != 0 {
		t.Fatalf("cancelling the change: %d, %v, next %d", before, err, next())
	}
	if _, err := runner.Seek(ctx, db.Pool, db.Schema, "relay", 0, 0, "op"); err != nil {
		t.Fatalf("a seek once the change is cancelled: %v", err)
	}
	if _, err := runner.SetPartitions(ctx, db.Pool, db.Schema, "relay", 4, "op"); err != nil || next() != 4 {
		t.Fatalf("SetPartitions again: %v, next %d", err, next())
	}
	// A replica with the new count may start during the change: it drains
	// the current partitions to the cut, and the count switches.
	start(t, db.Pool, lcfg("c"), rcfg, func(r *runner.Runner) error {
		return r.RegisterConsumer(counterGroup(db, "relay", 4, &target, poll))
	})
	waitFor(t, 30*time.Second, "a leader for each of the 4 partitions", led(4))
	r, err := runner.New(lockClient(t, db.Pool, lcfg("d")), rcfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.RegisterConsumer(counterGroup(db, "relay", 8, &target, poll)); err != nil {
		t.Fatal(err)
	}
	if err := r.Run(ctx); !errors.Is(err, runner.ErrPartitionCount) {
		t.Fatalf("Run with the old count after the change: %v, want ErrPartitionCount", err)
	}
}

// A Commit that returns the same offset counts as a commit and sets
// CommittedAt, but leaves AdvancedAt: a consumer stuck on an item does not
// look as if it were moving.
func TestAdvancedAtOnlyWhenTheOffsetMoves(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	done := make(chan struct{})
	var once sync.Once
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a"}, runner.Config{}, func(r *runner.Runner) error {
		return r.RegisterConsumer(runner.Consumer{Group: "stuck", Partitions: 1, Consume: func(ctx context.Context, p *runner.Partition) error {
			for _, next := range []int64{1, 1} {
				if err := p.Commit(ctx, func(context.Context, pgx.Tx) (int64, error) { return next, nil }); err != nil {
					return err
				}
			}
			once.Do(func() { close(done) })
			<-ctx.Done()
			return nil
		}})
	})
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("the group's two commits did not happen")
	}
	infos, err := runner.Partitions(ctx, db.Pool, db.Schema, "stuck")
	if err != nil || len(infos) != 1 {
		t.Fatalf("Partitions: %v, %v", infos, err)
	}
	p := infos[0]
	if p.Offset != 1 || p.Commits != 2 || p.AdvancedAt.IsZero() || !p.CommittedAt.After(p.AdvancedAt) {
		t.Errorf("after a commit to 1 and one that stayed at 1: offset %d, commits %d, advanced at %v, committed at %v; "+
			"want 1, 2, the first commit's time, and the second's (later)", p.Offset, p.Commits, p.AdvancedAt, p.CommittedAt)
	}
}

// A replica that gives a partition up to a joining one says so in its log,
// under group and partition, with why the term ended (not an error).
func TestRebalanceLogsWhyATermEnded(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	var target atomic.Int64
	const poll = 50 * time.Millisecond
	logs := pgtest.NewLogs()
	logs.LogOnFailure(t)
	lcfg := func(who string) lock.Config {
		return lock.Config{Schema: db.Schema, Holder: who, TTL: time.Second, PollInterval: poll}
	}
	rcfg := runner.Config{RebalanceInterval: 200 * time.Millisecond}
	acfg := lcfg("a")
	acfg.Logger = slog.New(logs)
	start(t, db.Pool, acfg, rcfg, func(r *runner.Runner) error {
		return r.RegisterConsumer(counterGroup(db, "relay", 4, &target, poll))
	})
	ctx := pgtest.Context(t, time.Minute)
	ledBy := func(who string) int {
		infos, err := runner.Partitions(ctx, db.Pool, db.Schema, "relay")
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, in := range infos {
			if in.Leading && in.Leader == who {
				n++
			}
		}
		return n
	}
	waitFor(t, 30*time.Second, "a to lead the 4 partitions", func() bool { return ledBy("a") == 4 })
	bcfg := lcfg("b")
	bcfg.Logger = slog.New(logs)
	start(t, db.Pool, bcfg, rcfg, func(r *runner.Runner) error {
		return r.RegisterConsumer(counterGroup(db, "relay", 4, &target, poll))
	})
	waitFor(t, 30*time.Second, "b to lead some partitions", func() bool { return ledBy("b") > 0 })
	waitFor(t, 10*time.Second, "a's line about a partition it gave up", func() bool {
		return len(logs.Find(slog.LevelInfo, "stopped leading")) > 0
	})
	if warned := logs.Find(slog.LevelWarn, "stopped leading"); len(warned) > 0 {
		t.Errorf("a rebalance logged a term's end as a warning: %v", warned)
	}
	for _, r := range logs.Find(slog.LevelInfo, "stopped leading") {
		attrs := map[string]string{}
		r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
		if attrs["group"] != "relay" || attrs["partition"] == "" || attrs["job"] != "" ||
			attrs["why"] != "moved to another replica by a rebalance" {
			t.Errorf("a partition moved by a rebalance is logged with %v", attrs)
		}
	}
	// The taker's side names the previous holder and why its term ended,
	// and the terms record says the same.
	bLeading := func() (out []slog.Record) {
		for _, r := range logs.Find(slog.LevelInfo, "runner: leading") {
			r.Attrs(func(a slog.Attr) bool {
				if a.Key == "holder" && a.Value.String() == "b" {
					out = append(out, r)
				}
				return true
			})
		}
		return out
	}
	waitFor(t, 10*time.Second, "b's line about a partition it took over", func() bool { return len(bLeading()) > 0 })
	took := 0
	for _, r := range bLeading() {
		attrs := map[string]string{}
		r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
		if attrs["holder"] == "b" {
			took++
			if attrs["previous_holder"] != "a" || attrs["previous_end"] != runner.EndMoved || attrs["previous_token"] == "" {
				t.Errorf("b took a partition over with %v; want previous_holder a, previous_end moved and a token", attrs)
			}
		}
	}
	if took == 0 {
		t.Error("b logged no partition it took over")
	}
	terms, err := runner.Terms(ctx, db.Pool, db.Schema, runner.TermFilter{Group: "relay", Limit: 100})
	if err != nil {
		t.Fatal(err)
	}
	moved := 0
	for _, tm := range terms {
		if tm.Group != "relay" || tm.Job != "" {
			t.Errorf("a term of another kind or name: %+v", tm)
		}
		if tm.Holder == "a" && tm.EndCause == runner.EndMoved {
			moved++
			if tm.Ended.Before(tm.Started) {
				t.Errorf("a term ended before it started: %+v", tm)
			}
		}
	}
	if moved == 0 {
		t.Errorf("no term of a ended as moved: %+v", terms)
	}
	// Every line of both replicas, the lock client's and the runner's,
	// names its instance once.
	for _, level := range []slog.Level{slog.LevelDebug, slog.LevelInfo, slog.LevelWarn, slog.LevelError} {
		for _, r := range logs.Find(level, "") {
			holders := 0
			r.Attrs(func(a slog.Attr) bool {
				if a.Key == "holder" {
					holders++
				}
				return true
			})
			if holders != 1 {
				t.Errorf("%q has %d holder attributes, want 1", r.Message, holders)
			}
		}
	}
}

// A term whose leader never closed it (killed, frozen past its lease, cut
// off) is closed by the next leader as expired, and the next leader's log
// names it.
func TestTermLeftOpenEndsAsExpired(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createEffects(t, db)
	ctx := pgtest.Context(t, time.Minute)
	// The row a leader killed in its term leaves behind, for partition 0
	// of relay (tokens start at 1: the next leader's is greater).
	if _, err := db.Pool.Exec(ctx, "INSERT INTO "+tbl(db, "pgfence_terms")+
		" (kind, name, shard, token, holder, started_at) VALUES ('group', 'relay', 0, 0, 'killed', now())"); err != nil {
		t.Fatal(err)
	}
	logs := pgtest.NewLogs()
	logs.LogOnFailure(t)
	var target atomic.Int64
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "next", Logger: slog.New(logs)}, runner.Config{}, func(r *runner.Runner) error {
		return r.RegisterConsumer(counterGroup(db, "relay", 1, &target, 50*time.Millisecond))
	})
	var terms []runner.Term
	waitFor(t, 30*time.Second, "the next leader's term", func() bool {
		var err error
		terms, err = runner.Terms(ctx, db.Pool, db.Schema, runner.TermFilter{Group: "relay"})
		if err != nil {
			t.Fatal(err)
		}
		return len(terms) == 2
	})
	if now, old := terms[0], terms[1]; now.Holder != "next" || !now.Ended.IsZero() || now.EndCause != "" ||
		old.Holder != "killed" || old.EndCause != runner.EndExpired || old.Ended.IsZero() {
		t.Fatalf("terms: %+v; want next's going on, and killed's ended as expired", terms)
	}
	// The leader logs once it has recorded its term: wait for the line.
	waitFor(t, 30*time.Second, "the next leader's log to say the previous term expired", func() bool {
		var named bool
		for _, r := range logs.Find(slog.LevelInfo, "leading") {
			r.Attrs(func(a slog.Attr) bool {
				named = named || a.Key == "previous_end" && a.Value.String() == runner.EndExpired
				return true
			})
		}
		return named
	})
}

// Seek sets a partition's offset through its fence: the leader's lease is
// revoked in the same transaction (its guarded writes are refused from
// then on, and it loses the lease), the offset carries the revoking token,
// and the next term resumes at the sought offset.
func TestSeekFencesTheLeader(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	type term struct {
		p      *runner.Partition
		offset int64
	}
	terms := make(chan term, 10)
	// The first term commits 5 in a transaction held open until released
	// (the seek must wait for it); then it waits, and on demand tries to
	// commit 6 (after the seek: refused).
	inCommit, release, again := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	second := make(chan struct{}) // closed once the seek has returned
	var first atomic.Bool
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a", TTL: 3 * time.Second, PollInterval: 50 * time.Millisecond, Logger: pgtest.Quiet},
		runner.Config{}, func(r *runner.Runner) error {
			return r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 1, Poll: 50 * time.Millisecond,
				Consume: func(ctx context.Context, p *runner.Partition) error {
					terms <- term{p, p.Offset()}
					if first.CompareAndSwap(false, true) {
						if err := p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
							// A statement first: the fence's check rides with
							// it and holds the lease row from then on.
							if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
								return 0, err
							}
							close(inCommit)
							select {
							case <-release:
							case <-ctx.Done():
								return 0, ctx.Err()
							}
							return 5, nil
						}); err != nil {
							return err
						}
						<-second
						again <- p.Commit(context.WithoutCancel(ctx), func(context.Context, pgx.Tx) (int64, error) { return 6, nil })
					}
					<-ctx.Done()
					return nil
				}})
		})
	if _, err := runner.Seek(ctx, db.Pool, db.Schema, "relay", 1, 7, "operator"); !errors.Is(err, runner.ErrUnknownJob) {
		t.Fatalf("Seek of a partition never led: %v, want ErrUnknownJob", err)
	}
	if _, err := runner.Seek(ctx, db.Pool, db.Schema, "relay", 0, -1, "operator"); !errors.Is(err, runner.ErrInvalidOffset) {
		t.Fatalf("Seek to a negative offset: %v, want ErrInvalidOffset", err)
	}
	firstTerm := <-terms
	select {
	case <-inCommit:
	case <-ctx.Done():
		t.Fatal("the leader never began its Commit")
	}
	type result struct {
		before int64
		err    error
	}
	sought := make(chan result, 1)
	go func() {
		before, err := runner.Seek(ctx, db.Pool, db.Schema, "relay", 0, 7, "operator")
		sought <- result{before, err}
	}()
	// The seek waits on the lease row while the leader's transaction is
	// open (its check holds the row).
	waitFor(t, 30*time.Second, "the seek to wait for the leader's transaction", func() bool {
		var waiting bool
		if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE '%'||$1||'%pgfence_leases%')`, db.Schema).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting
	})
	select {
	case r := <-sought:
		t.Fatalf("the seek returned while the leader's transaction was open: %+v", r)
	default:
	}
	close(release)
	var r result
	select {
	case r = <-sought:
	case <-ctx.Done():
		t.Fatal("the seek never returned")
	}
	if r.err != nil || r.before != 5 {
		t.Fatalf("Seek: %d, %v; want 5 before (the leader's commit, which it waited for)", r.before, r.err)
	}
	close(second)
	// The revoked term's next Commit is refused, and moves nothing.
	select {
	case err := <-again:
		if !errors.Is(err, fence.ErrFenced) {
			t.Fatalf("a Commit of the revoked term: %v, want ErrFenced", err)
		}
	case <-ctx.Done():
		t.Fatal("the revoked term's second Commit never returned")
	}
	select {
	case <-firstTerm.p.Lease().Done():
	case <-ctx.Done():
		t.Fatal("the revoked term's lease was never lost")
	}
	infos, err := runner.Partitions(ctx, db.Pool, db.Schema, "relay")
	if err != nil || len(infos) != 1 || infos[0].Offset != 7 || infos[0].Committer != "operator" || infos[0].Token <= firstTerm.p.Token {
		t.Fatalf("Partitions after the seek: %+v, %v; want offset 7 by operator with a token above the first term's", infos, err)
	}
	revoking := infos[0].Token
	var next term
	select {
	case next = <-terms:
	case <-ctx.Done():
		t.Fatal("no next term")
	}
	if next.offset != 7 || next.p.Token <= revoking {
		t.Fatalf("next term: token %v from offset %d; want a token above the revoking one (%v) and offset 7", next.p.Token, next.offset, revoking)
	}
	ts, err := runner.Terms(ctx, db.Pool, db.Schema, runner.TermFilter{Group: "relay"})
	if err != nil || len(ts) != 2 || ts[1].Token != firstTerm.p.Token || ts[1].EndCause != runner.EndRevoked {
		t.Fatalf("terms after the seek: %+v, %v; want the first ended as revoked", ts, err)
	}
}

// A change of the partition count while rows flow, through the documented
// path (SetPartitions with the replicas running): 4 partitions over two
// replicas, then 8, then 3, while a producer writes events for 20 keys.
// Every event is delivered once (the sink's key refuses a second
// delivery), in order per key, and no partition of the current count is
// without a leader for longer than TTL + PollInterval.
func TestPartitionCountChangeWhileRowsFlow(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, 3*time.Minute)
	items, sink := tbl(db, "items"), tbl(db, "sink")
	mustExec(t, db, "CREATE TABLE "+items+" (id bigserial PRIMARY KEY, k int NOT NULL, seq int NOT NULL,"+
		" txid bigint NOT NULL DEFAULT pg_current_xact_id()::text::bigint)")
	mustExec(t, db, "CREATE TABLE "+sink+" (id bigint PRIMARY KEY, k int NOT NULL, seq int NOT NULL, n bigserial)")
	const (
		ttl  = time.Second
		poll = 50 * time.Millisecond
		keys = 20
	)
	var dupes atomic.Int64
	// The consumer: the events of its partition (k mod the term's count)
	// from its offset (a transaction id) to the snapshot's xmin or the
	// cut, whichever comes first, delivered with the offset after them.
	consume := func(ctx context.Context, p *runner.Partition) error {
		for ctx.Err() == nil {
			err := p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
				var next int64
				err := tx.QueryRow(ctx, `WITH snap AS (SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin),
batch AS (SELECT i.id, i.k, i.seq, i.txid FROM `+items+` i, snap
           WHERE i.txid >= $1 AND i.txid < least(snap.xmin, $2) AND i.k % $3 = $4 ORDER BY i.txid, i.id LIMIT 200),
ins AS (INSERT INTO `+sink+` (id, k, seq) SELECT id, k, seq FROM batch ORDER BY txid, id)
SELECT CASE WHEN count(*) = 200 THEN max(txid) + 1 ELSE greatest($1, least((SELECT xmin FROM snap), $2)) END FROM batch`,
					p.Offset(), p.Until(), p.Partitions, p.Index).Scan(&next)
				return next, err
			})
			var pg *pgconn.PgError
			if errors.As(err, &pg) && pg.Code == "23505" {
				dupes.Add(1)
			}
			if err != nil {
				return err
			}
			if err := p.Wait(ctx); err != nil {
				return nil
			}
		}
		return nil
	}
	group := func(n int) runner.Consumer {
		return runner.Consumer{Group: "flow", Partitions: n, Poll: poll, Consume: consume}
	}
	lcfg := func(who string) lock.Config {
		return lock.Config{Schema: db.Schema, Holder: who, TTL: ttl, PollInterval: poll, Logger: pgtest.Quiet}
	}
	rcfg := runner.Config{RebalanceInterval: 200 * time.Millisecond}
	for _, who := range []string{"a", "b"} {
		start(t, db.Pool, lcfg(who), rcfg, func(r *runner.Runner) error { return r.RegisterConsumer(group(4)) })
	}

	// The producer: one event per transaction, each key's in order. It
	// stops between inserts (an insert cancelled in flight may still
	// commit after the producer has returned).
	var stop atomic.Bool
	stopProducing := func() { stop.Store(true) }
	produced := make(chan int, 1)
	go func() {
		i := 0
		for !stop.Load() && ctx.Err() == nil {
			if _, err := db.Pool.Exec(ctx, "INSERT INTO "+items+" (k, seq) VALUES ($1, $2)", i%keys, i/keys); err != nil {
				break
			}
			i++
			time.Sleep(2 * time.Millisecond)
		}
		produced <- i
	}()
	defer stopProducing()

	// The watcher: the longest time a partition of the current count was
	// without a leader.
	var (
		mu       sync.Mutex
		worst    time.Duration
		worstFor string
	)
	watch, stopWatching := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		since := map[int]time.Time{}
		for watch.Err() == nil {
			gs, err1 := runner.Groups(watch, db.Pool, db.Schema, "flow")
			parts, err2 := runner.Partitions(watch, db.Pool, db.Schema, "flow")
			now := time.Now()
			if err1 == nil && err2 == nil && len(gs) == 1 {
				leading := map[int]bool{}
				for _, p := range parts {
					leading[p.Partition] = p.Leading
				}
				for p := range gs[0].Partitions {
					if leading[p] {
						if at, ok := since[p]; ok {
							mu.Lock()
							if d := now.Sub(at); d > worst {
								worst, worstFor = d, fmt.Sprintf("partition %d of %d", p, gs[0].Partitions)
							}
							mu.Unlock()
						}
						delete(since, p)
					} else if _, ok := since[p]; !ok {
						since[p] = now
					}
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()

	delivered := func() int {
		var n int
		if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+sink).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	count := func() runner.GroupInfo {
		gs, err := runner.Groups(ctx, db.Pool, db.Schema, "flow")
		if err != nil || len(gs) != 1 {
			t.Fatalf("Groups: %+v, %v", gs, err)
		}
		return gs[0]
	}
	waitFor(t, 30*time.Second, "events delivered by 4 partitions", func() bool { return delivered() > 100 })
	for _, n := range []int{8, 3} {
		before := count().Partitions
		if got, err := runner.SetPartitions(ctx, db.Pool, db.Schema, "flow", n, "op"); err != nil || got != before {
			t.Fatalf("SetPartitions to %d while running: %d, %v; want %d before", n, got, err, before)
		}
		if _, err := runner.SetPartitions(ctx, db.Pool, db.Schema, "flow", n+1, "op"); !errors.Is(err, runner.ErrGroupChanging) {
			if err != nil {
				t.Fatalf("a second change while one is under way: %v, want ErrGroupChanging", err)
			}
			// Accepted: right only if the first change had already ended
			// (every partition was at its cut), and this is a new one,
			// pending or (as fast) done. Asking for n again cancels it,
			// or changes back.
			if g := count(); !(g.Partitions == n && g.Next == n+1 || g.Partitions == n+1 && g.Next == 0) {
				t.Fatalf("a second change while one is under way was accepted: %+v", g)
			}
			t.Logf("the change to %d partitions ended before the next call; undoing the change that call began", n)
			if _, err := runner.SetPartitions(ctx, db.Pool, db.Schema, "flow", n, "op"); err != nil {
				t.Fatal(err)
			}
		}
		waitFor(t, 60*time.Second, fmt.Sprintf("the change to %d partitions to end", n), func() bool {
			g := count()
			return g.Partitions == n && g.Next == 0
		})
		at := delivered()
		waitFor(t, 30*time.Second, fmt.Sprintf("events delivered by %d partitions", n), func() bool { return delivered() > at+100 })
	}
	stopProducing()
	total := <-produced
	waitFor(t, 60*time.Second, "every event delivered", func() bool { return delivered() >= total })
	stopWatching()
	<-watched

	if n := delivered(); n != total || dupes.Load() != 0 {
		t.Errorf("%d events produced, %d delivered, %d deliveries refused as duplicates", total, n, dupes.Load())
	}
	rows, err := db.Pool.Query(ctx, `SELECT k, seq, prev FROM (SELECT k, seq, lag(seq) OVER (PARTITION BY k ORDER BY n) AS prev FROM `+
		sink+`) x WHERE seq <> prev + 1`)
	if err != nil {
		t.Fatal(err)
	}
	type disorder struct{ k, seq, prev int }
	bad, err := pgx.CollectRows(rows, pgx.RowToStructByPos[disorder])
	if err != nil || len(bad) > 0 {
		t.Errorf("events of a key delivered out of order (key, seq, previous): %v %v", bad, err)
	}
	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d events, two changes of the count; longest without a leader: %v (%s)", total, worst, worstFor)
	if worst > ttl+poll {
		t.Errorf("%s was without a leader for %v, more than TTL + PollInterval (%v)", worstFor, worst, ttl+poll)
	}
}

// Commit's function gets a context with the caller's values and deadline
// that ends with the lease, not with the caller's cancellation.
func TestCommitContextKeepsCallerValues(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	type key struct{}
	type seen struct {
		value       any
		deadline    time.Time
		hasDeadline bool
		endedWith   error // the function's context's cause
	}
	got := make(chan seen, 1)
	entered := make(chan context.CancelFunc, 1) // the caller's cancel, once the function runs
	callerDeadline := time.Now().Add(40 * time.Second)
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a", TTL: time.Second, PollInterval: 50 * time.Millisecond, Logger: pgtest.Quiet},
		runner.Config{}, func(r *runner.Runner) error {
			var once sync.Once
			return r.RegisterConsumer(runner.Consumer{Group: "ctx", Partitions: 1, Consume: func(lctx context.Context, p *runner.Partition) error {
				once.Do(func() {
					// A caller's context of its own (a request's, say).
					caller, cancel := context.WithDeadline(context.WithValue(context.Background(), key{}, "span-42"), callerDeadline)
					defer cancel()
					_ = p.Commit(caller, func(fctx context.Context, tx pgx.Tx) (int64, error) {
						var s seen
						s.value = fctx.Value(key{})
						s.deadline, s.hasDeadline = fctx.Deadline()
						entered <- cancel
						<-fctx.Done()
						s.endedWith = context.Cause(fctx)
						got <- s
						return 0, fctx.Err()
					})
				})
				<-lctx.Done()
				return nil
			}})
		})
	var cancelCaller context.CancelFunc
	select {
	case cancelCaller = <-entered:
	case <-ctx.Done():
		t.Fatal("Commit's function never ran")
	}
	// The caller's cancellation does not end the transaction's context;
	// revoking the partition's lease does (the function has sent no
	// statement, so the revocation waits for nothing).
	cancelCaller()
	if _, err := runner.Seek(ctx, db.Pool, db.Schema, "ctx", 0, 0, "op"); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-got:
		if s.value != "span-42" || !s.hasDeadline || !s.deadline.Equal(callerDeadline) || !errors.Is(s.endedWith, lock.ErrLeaseLost) {
			t.Fatalf("Commit's function saw value %v, deadline %v (%v), ended with %v; want span-42, the caller's deadline, ErrLeaseLost",
				s.value, s.deadline, s.hasDeadline, s.endedWith)
		}
	case <-ctx.Done():
		t.Fatal("Commit's function's context did not end with the lease")
	}
}

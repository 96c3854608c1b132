package bouncer_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/bouncer"
	"github.com/pgfence/pgfence/internal/expiry"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// start runs a PgBouncer (transaction pooling, poolSize server connections)
// in front of the test server and returns it with the test's database area.
func start(t *testing.T, poolSize int) (*bouncer.Bouncer, *pgtest.DB, *pgx.ConnConfig) {
	t.Helper()
	db := pgtest.New(t)
	up, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	b, err := bouncer.Start(fmt.Sprintf("%s:%d", up.Host, up.Port), up.User, poolSize)
	pgtest.NeedTool(t, err, bouncer.ErrNoBinary)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b, db, up
}

// poolThrough connects through PgBouncer with one of pgx's exec modes that
// PgBouncer before 1.21 supports in transaction mode (no named prepared
// statements kept across transactions).
func poolThrough(t *testing.T, b *bouncer.Bouncer, up *pgx.ConnConfig, mode string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(b.URL(up.User, up.Database, "default_query_exec_mode="+mode))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

var modes = []string{"exec", "simple_protocol"}

// Leases, renewals, the held error, release and re-acquisition work through
// transaction pooling: each is a single statement or one pipelined implicit
// transaction, with no session state.
func TestLeasesThroughPgBouncer(t *testing.T) {
	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) {
			b, db, up := start(t, 4)
			ctx := pgtest.Context(t, time.Minute)
			pool := poolThrough(t, b, up, mode)
			newClient := func(holder string) *lock.Client {
				c, err := lock.New(pool, lock.Config{Schema: db.Schema, Holder: holder, TTL: 3 * time.Second,
					RenewInterval: 500 * time.Millisecond, SafetyMargin: 300 * time.Millisecond, PollInterval: 200 * time.Millisecond, Logger: pgtest.Quiet})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = c.Close(context.Background()) })
				return c
			}
			a, other := newClient("a"), newClient("b")
			l, err := a.TryAcquire(ctx, "pooled")
			if err != nil {
				t.Fatal(err)
			}
			var held *lock.HeldError
			if _, err := other.TryAcquire(ctx, "pooled"); !errors.As(err, &held) || held.Holder != "a" || held.Token != l.Token() {
				t.Fatalf("second TryAcquire = %v, want held by a with token %d", err, l.Token())
			}
			// Renewals keep the lease through PgBouncer: after 2 TTLs of
			// them (however long a loaded machine takes) it is still live,
			// with the same token.
			acquired, renewals := time.Now(), a.Stats().Renewals
			pgtest.Eventually(t, 30*time.Second, "2 TTLs of renewals", func() bool {
				return a.Stats().Renewals-renewals >= 12 && time.Since(acquired) > 6*time.Second || l.Err() != nil
			})
			if err := l.Check(ctx); err != nil {
				t.Fatalf("lease after 2 TTLs of renewals: %v", err)
			}
			// A blocked Acquire: LISTEN does not survive transaction pooling,
			// so the waiter must find the release by polling.
			got := make(chan *lock.Lease, 1)
			go func() {
				l2, err := other.Acquire(ctx, "pooled")
				if err != nil {
					t.Error(err)
				}
				got <- l2
			}()
			// The waiter waits once its poller has marked the row.
			pgtest.Eventually(t, 30*time.Second, "the waiter to wait", func() bool {
				var marked bool
				_ = db.Pool.QueryRow(ctx, "SELECT waiters_until IS NOT NULL FROM "+pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()+
					" WHERE name = 'pooled'").Scan(&marked)
				return marked
			})
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			released := time.Now()
			select {
			case l2 := <-got:
				if l2 == nil || l2.Token() <= l.Token() {
					t.Fatalf("waiter got %v after token %d", l2, l.Token())
				}
				t.Logf("%s: waiter acquired %v after the release", mode, time.Since(released).Round(time.Millisecond))
			case <-time.After(3 * time.Second):
				t.Fatal("the waiter did not acquire within 3s of the release (poll interval 200ms)")
			}
		})
	}
}

// A holder frozen inside a guarded transaction behind PgBouncer: its server
// backend sits idle in the transaction, holding the lease row, and the
// taker's backend is not known (the pooler announces its own key, not the
// backend's). Once the lease has expired the taker, also behind PgBouncer,
// still ends that backend and takes the lease, the frozen transaction dead.
// The control: a taker that does not end idle holders (IdleHolderAfter
// negative) is still waiting after 3 s, so the test can tell.
func TestFrozenHolderBehindPgBouncerIsTakenOver(t *testing.T) {
	b, db, up := start(t, 4)
	ctx := pgtest.Context(t, time.Minute)
	pool := poolThrough(t, b, up, "exec")
	newClient := func(holder string, idleAfter time.Duration) *lock.Client {
		c, err := lock.New(pool, lock.Config{Schema: db.Schema, Holder: holder, TTL: 600 * time.Millisecond,
			RenewInterval: 100 * time.Millisecond, SafetyMargin: 50 * time.Millisecond, PollInterval: 200 * time.Millisecond,
			IdleHolderAfter: idleAfter, Logger: pgtest.Quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}
	holder := newClient("frozen", 0)
	l, err := holder.TryAcquire(ctx, "frozen")
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := l.Guard().Check(ctx, tx); err != nil {
		t.Fatal(err)
	}
	// The holder freezes: the transaction stays open, idle, and the lease
	// expires at the database.
	if _, err := db.Pool.Exec(ctx, expiry.SQL(db.Schema), "frozen"); err != nil {
		t.Fatal(err)
	}

	patient := newClient("patient", -1)
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = patient.Acquire(wctx, "frozen")
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a taker that waits for idle holders, behind the frozen guarded transaction: %v, want its deadline", err)
	}

	taker := newClient("taker", 0)
	next, err := taker.Acquire(ctx, "frozen")
	if err != nil {
		t.Fatalf("takeover behind PgBouncer of a holder frozen in a guarded transaction: %v", err)
	}
	defer next.Release(ctx)
	if next.Token() <= l.Token() {
		t.Fatalf("token %d after %d", next.Token(), l.Token())
	}
	if n := taker.Stats().IdleHoldersEnded; n != 1 {
		t.Fatalf("IdleHoldersEnded = %d, want 1", n)
	}
	if _, err := tx.Exec(ctx, "SELECT 1"); err == nil {
		t.Fatal("the frozen guarded transaction is still alive after the takeover")
	}
}

// Guarded transactions through PgBouncer: the current token commits, a
// stale one is refused and leaves nothing behind. And the asynchronous
// release's synchronous_commit = off stays inside its own transaction: the
// single server connection PgBouncer shares between clients is back to
// synchronous_commit = on for whoever uses it next.
func TestFenceThroughPgBouncer(t *testing.T) {
	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) {
			b, db, up := start(t, 1)
			ctx := pgtest.Context(t, time.Minute)
			pool := poolThrough(t, b, up, mode)
			tbl := pgx.Identifier{db.Schema, "writes"}.Sanitize()
			if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+tbl+" (token bigint NOT NULL)"); err != nil {
				t.Fatal(err)
			}
			c, err := lock.New(pool, lock.Config{Schema: db.Schema, Logger: pgtest.Quiet})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close(context.Background())
			old, err := c.TryAcquire(ctx, "fenced")
			if err != nil {
				t.Fatal(err)
			}
			write := func(l *lock.Lease) error {
				return l.RunTx(ctx, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES ($1)", int64(l.Token()))
					return err
				})
			}
			if err := write(old); err != nil {
				t.Fatalf("guarded write with the current token: %v", err)
			}
			if err := old.Release(ctx); err != nil {
				t.Fatal(err)
			}
			var sc string
			if err := pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&sc); err != nil || sc != "on" {
				t.Fatalf("synchronous_commit after a release, on PgBouncer's only server connection: %q, %v", sc, err)
			}
			next, err := c.TryAcquire(ctx, "fenced")
			if err != nil {
				t.Fatal(err)
			}
			defer next.Release(ctx)
			// The old holder's guard, used after the takeover, is refused.
			err = old.Guard().RunTx(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES ($1)", int64(old.Token()))
				return err
			})
			if !errors.Is(err, fence.ErrStaleToken) {
				t.Fatalf("stale guarded write = %v, want ErrStaleToken", err)
			}
			var n int
			if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+tbl).Scan(&n); err != nil || n != 1 {
				t.Fatalf("rows written: %d, %v; want only the current holder's 1", n, err)
			}
		})
	}
}

// A manual run asked for while the job's leader talks to the database
// through PgBouncer (transaction pooling: the NOTIFY that wakes it never
// arrives) still runs: the leader finds it at its next heartbeat.
func TestRunNowThroughPgBouncer(t *testing.T) {
	b, db, up := start(t, 4)
	ctx := pgtest.Context(t, time.Minute)
	pool := poolThrough(t, b, up, "exec")
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, Holder: "pooled", TTL: 2 * time.Second, PollInterval: 200 * time.Millisecond,
		Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	r, err := runner.New(c, runner.Config{RebalanceInterval: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Register(runner.Job{Name: "report", Schedule: "@every 1h", Run: func(context.Context, *runner.Run) error { return nil }}); err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	pgtest.Eventually(t, 10*time.Second, "the job to have a leader", func() bool {
		jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "report")
		return err == nil && len(jobs) == 1 && jobs[0].Leader == "pooled"
	})
	refs, err := runner.RunNow(ctx, db.Pool, db.Schema, "report", 0, "the test")
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ri, err := runner.WaitRun(wctx, db.Pool, db.Schema, refs[0])
	if err != nil || ri.Status != runner.StatusSucceeded {
		t.Fatalf("the manual run through PgBouncer: %+v, %v; want it run within 5s (heartbeats every 300ms)", ri, err)
	}
}

// Observe through PgBouncer: its notifications cannot arrive, so it sees a
// new holder at its next read, within a PollInterval (200ms here).
func TestObserveThroughPgBouncer(t *testing.T) {
	b, db, up := start(t, 4)
	ctx := pgtest.Context(t, time.Minute)
	pool := poolThrough(t, b, up, "exec")
	newClient := func(holder string) *lock.Client {
		c, err := lock.New(pool, lock.Config{Schema: db.Schema, Holder: holder, PollInterval: 200 * time.Millisecond, Logger: pgtest.Quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}
	observer, holder := newClient("observer"), newClient("holder")
	seen, err := observer.Observe(ctx, "watched")
	if err != nil {
		t.Fatal(err)
	}
	if i := <-seen; i.Held {
		t.Fatalf("first state: %+v, want free", i)
	}
	l, err := holder.TryAcquire(ctx, "watched")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case i := <-seen:
		if !i.Held || i.Holder != "holder" || i.Token != l.Token() {
			t.Fatalf("after the acquisition: %+v, want holder with token %d", i, l.Token())
		}
	case <-time.After(3 * time.Second):
		t.Fatal("no news of the acquisition within 3s (reads every 200ms)")
	}
}

// A consumer group's partition leader behind PgBouncer, in both exec
// modes without prepared statements: a wake-up's NOTIFY is not to be relied
// on there (transaction pooling), and the leader finds the work at its
// next Poll either way; Partition.Commit (the check, the effects and the
// offset in one transaction), the terms' records, a fenced seek and a
// change of the partition count with the replica running all work
// through transaction pooling.
func TestConsumerGroupThroughPgBouncer(t *testing.T) {
	for _, mode := range modes {
		t.Run(mode, func(t *testing.T) { consumerGroupThroughPgBouncer(t, mode) })
	}
}

func consumerGroupThroughPgBouncer(t *testing.T, mode string) {
	b, db, up := start(t, 4)
	ctx := pgtest.Context(t, time.Minute)
	pool := poolThrough(t, b, up, mode)
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{db.Schema, "work"}.Sanitize()+" (n bigint PRIMARY KEY, done bool NOT NULL DEFAULT false)"); err != nil {
		t.Fatal(err)
	}
	work := pgx.Identifier{db.Schema, "work"}.Sanitize()
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, Holder: "pooled", TTL: 2 * time.Second, PollInterval: 200 * time.Millisecond,
		Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	r, err := runner.New(c, runner.Config{RebalanceInterval: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	// Items n of the partition n mod the count, from the offset on; the
	// offset after them is committed with them.
	err = r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 1, Poll: 200 * time.Millisecond,
		Consume: func(ctx context.Context, p *runner.Partition) error {
			for ctx.Err() == nil {
				if err := p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
					var next int64
					err := tx.QueryRow(ctx, "WITH d AS (UPDATE "+work+" SET done = true WHERE n >= $1 AND n < $2 AND n % $3 = $4 RETURNING n)"+
						" SELECT coalesce(max(n) + 1, $1) FROM d", p.Offset(), p.Until(), p.Partitions, p.Index).Scan(&next)
					return next, err
				}); err != nil {
					return err
				}
				if err := p.Wait(ctx); err != nil {
					return nil
				}
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	offsets := func() map[int]int64 {
		ps, err := runner.Partitions(ctx, pool, db.Schema, "relay")
		if err != nil {
			t.Fatal(err)
		}
		out := map[int]int64{}
		for _, p := range ps {
			if p.Leading && p.Leader == "pooled" {
				out[p.Partition] = p.Offset
			}
		}
		return out
	}
	pgtest.Eventually(t, 10*time.Second, "the partition to have a leader", func() bool { return len(offsets()) == 1 })
	// The work arrives with its wake-up, written directly to the server.
	add := func(ns ...int) {
		t.Helper()
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range ns {
			if _, err := tx.Exec(ctx, "INSERT INTO "+work+" (n) VALUES ($1)", n); err != nil {
				t.Fatal(err)
			}
		}
		if err := runner.Wake(ctx, tx, db.Schema, "relay", 0); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	add(1, 2, 3)
	pgtest.Eventually(t, 10*time.Second, "the work done and the offset at 4 (Poll every 200ms)", func() bool {
		return offsets()[0] == 4
	})
	// A fenced seek back to 2, through the pool: the next term redoes 2
	// and 3, and comes back to 4.
	if before, err := runner.Seek(ctx, pool, db.Schema, "relay", 0, 2, "op"); err != nil || before != 4 {
		t.Fatalf("Seek through PgBouncer: %d, %v", before, err)
	}
	terms, err := runner.Terms(ctx, pool, db.Schema, runner.TermFilter{Group: "relay"})
	if err != nil || len(terms) == 0 || terms[0].EndCause != runner.EndRevoked {
		t.Fatalf("terms after the seek, through PgBouncer: %+v, %v", terms, err)
	}
	pgtest.Eventually(t, 10*time.Second, "the partition led again and back at 4", func() bool { return offsets()[0] == 4 })
	// Two partitions, the replica running: the cut is 4, which partition 0
	// has reached, so the count switches at once.
	if before, err := runner.SetPartitions(ctx, pool, db.Schema, "relay", 2, "op"); err != nil || before != 1 {
		t.Fatalf("SetPartitions through PgBouncer: %d, %v", before, err)
	}
	pgtest.Eventually(t, 20*time.Second, "both partitions led from the cut", func() bool {
		o := offsets()
		return len(o) == 2 && o[0] >= 4 && o[1] >= 4
	})
	add(5, 6)
	pgtest.Eventually(t, 10*time.Second, "5 done by partition 1 and 6 by partition 0", func() bool {
		o := offsets()
		return o[0] == 7 && o[1] == 6
	})
	var left int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+work+" WHERE NOT done").Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d rows not done (%v)", left, err)
	}
}

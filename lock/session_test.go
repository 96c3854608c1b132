package lock_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/expiry"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// A renewal costs the same for one lease as for thousands: holding 5,000
// leases through three renewals rewrites the client's session row and no
// lease row (each row's xmin is the transaction that last wrote it).
func TestRenewalWritesOneRowWhateverTheLeases(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, 2*time.Minute)
	const n = 5000
	// A TTL far above the RenewInterval: the test counts renewals and
	// failures, not expiry, and its 5,000 acquisitions load the machine.
	c := newClient(t, db, lock.Config{TTL: 30 * time.Second, RenewInterval: time.Second})
	var (
		wg    sync.WaitGroup
		next  atomic.Int64
		first error
		mu    sync.Mutex
	)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1) - 1; i < n; i = next.Add(1) - 1 {
				if _, err := c.TryAcquire(ctx, fmt.Sprintf("many-%d", i)); err != nil {
					mu.Lock()
					first = errors.Join(first, err)
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	if first != nil {
		t.Fatal(first)
	}
	xmins := func() (leases map[string]string, session string) {
		leases = map[string]string{}
		rows, err := db.Pool.Query(ctx, "SELECT name, xmin::text FROM "+db.Schema+".pgfence_leases WHERE name LIKE 'many-%'")
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var name, xmin string
			if err := rows.Scan(&name, &xmin); err != nil {
				t.Fatal(err)
			}
			leases[name] = xmin
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if err := db.Pool.QueryRow(ctx, "SELECT s.xmin::text FROM "+db.Schema+".pgfence_sessions s WHERE s.id = "+
			"(SELECT session FROM "+db.Schema+".pgfence_leases WHERE name = 'many-0')").Scan(&session); err != nil {
			t.Fatal(err)
		}
		return leases, session
	}
	before, s0 := xmins()
	if len(before) != n {
		t.Fatalf("%d lease rows, want %d", len(before), n)
	}
	r0 := c.Stats().Renewals
	pgtest.Eventually(t, time.Minute, "three renewals", func() bool { return c.Stats().Renewals >= r0+3 })
	after, s1 := xmins()
	rewritten := 0
	for name, x := range before {
		if after[name] != x {
			rewritten++
		}
	}
	if rewritten != 0 || s1 == s0 {
		t.Fatalf("three renewals rewrote %d of %d lease rows and the session row: %v; want no lease row, the session row", rewritten, n, s1 != s0)
	}
	if st := c.Stats(); st.Held != n || st.RenewalFailures != 0 {
		t.Fatalf("after the renewals: %+v; want %d held, no failure", st, n)
	}
}

// Acquisitions do not wait for the renewals: while the session's renewal
// waits at the database (a transaction holds its row), the client still
// acquires new leases.
func TestAcquireDoesNotWaitForRenewals(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c := newClient(t, db, lock.Config{TTL: 30 * time.Second, RenewInterval: time.Second})
	if _, err := c.TryAcquire(ctx, "first"); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var pid int
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid() FROM "+db.Schema+".pgfence_sessions WHERE id = "+
		"(SELECT session FROM "+db.Schema+".pgfence_leases WHERE name = 'first') FOR UPDATE").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	renewalWaits := func() bool {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid).Scan(&n)
		return n > 0
	}
	pgtest.Eventually(t, 30*time.Second, "the renewal to wait for the session row", renewalWaits)
	for i := range 20 {
		if _, err := c.TryAcquire(ctx, fmt.Sprintf("more-%d", i)); err != nil {
			t.Fatalf("acquisition %d while the renewal waits: %v", i, err)
		}
	}
	if !renewalWaits() {
		t.Fatal("the renewal stopped waiting before the acquisitions were done: the test proves nothing")
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	r0 := c.Stats().Renewals
	pgtest.Eventually(t, 30*time.Second, "a renewal once the row is free", func() bool { return c.Stats().Renewals > r0 })
	if st := c.Stats(); st.Held != 21 {
		t.Fatalf("%+v; want 21 held", st)
	}
}

// A takeover and a renewal in flight serialise on the session row: a
// takeover that found the session expired waits for the renewal that
// holds its row, and takes nothing once that renewal commits; if the
// renewal rolls back, the takeover goes through (the negative control).
func TestTakeoverWaitsForTheRenewalInFlight(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	for _, commit := range []bool{true, false} {
		name := fmt.Sprintf("serialised-%v", commit)
		a := newClient(t, db, lock.Config{Holder: "a"})
		a.SetClock(clock.NewFake(time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))) // a's renewer never runs
		held, err := a.TryAcquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		session := "(SELECT session FROM " + db.Schema + ".pgfence_leases WHERE name = '" + name + "')"
		if _, err := db.Pool.Exec(ctx, "UPDATE "+db.Schema+".pgfence_sessions SET expires_at = now() - interval '1 second' WHERE id = "+session); err != nil {
			t.Fatal(err)
		}
		renewal, err := db.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = renewal.Rollback(context.Background()) })
		var pid int
		if err := renewal.QueryRow(ctx, "UPDATE "+db.Schema+".pgfence_sessions SET expires_at = now() + interval '1 hour' WHERE id = "+
			session+" RETURNING pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		// b waits for the transaction standing in for the renewal, which
		// sits idle: b must not end it as a frozen holder's.
		b := newClient(t, db, lock.Config{Holder: "b", IdleHolderAfter: -1})
		done := make(chan error, 1)
		var got *lock.Lease
		go func() {
			l, err := b.TryAcquire(ctx, name)
			got = l
			done <- err
		}()
		pgtest.Eventually(t, 30*time.Second, "the takeover to wait for the renewal", func() bool {
			var n int
			_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid).Scan(&n)
			return n > 0
		})
		if commit {
			err = renewal.Commit(ctx)
		} else {
			err = renewal.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		err = <-done
		var he *lock.HeldError
		switch {
		case commit && (!errors.As(err, &he) || he.Holder != "a" || he.Token != held.Token()):
			t.Fatalf("takeover behind a renewal that committed: %v; want held by a with token %s", err, held.Token())
		case !commit && (err != nil || got.Token() <= held.Token()):
			t.Fatalf("takeover behind a renewal that rolled back: %v; want a lease above token %s", err, held.Token())
		}
	}
}

// When a client's session expired at the database and a lease of it was
// taken, the client's next renewal ends the session, and every lease with
// it, each with its cause: the one taken over, the other expired.
func TestExpiredSessionEndsEveryLease(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	a := newClient(t, db, lock.Config{Holder: "a", TTL: 3 * time.Second})
	fake := clock.NewFake(time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))
	a.SetClock(fake) // a's renewer runs when the test says
	x, err := a.TryAcquire(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	y, err := a.TryAcquire(ctx, "y")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, "UPDATE "+db.Schema+".pgfence_sessions SET expires_at = now() WHERE id = "+
		"(SELECT session FROM "+db.Schema+".pgfence_leases WHERE name = 'x')"); err != nil {
		t.Fatal(err)
	}
	b := newClient(t, db, lock.Config{Holder: "b"})
	bx, err := b.TryAcquire(ctx, "x")
	if err != nil || bx.Token() <= x.Token() {
		t.Fatalf("takeover of a lease whose session expired: %v", err)
	}
	fake.Advance(a.Config().RenewInterval) // the renewal: it finds the session expired
	for _, tc := range []struct {
		l     *lock.Lease
		cause string
	}{{x, "taken over"}, {y, "expired"}} {
		select {
		case <-tc.l.Done():
		case <-ctx.Done():
			t.Fatalf("%s: still live after the renewal that found its session expired", tc.l.Name())
		}
		if err := tc.l.Err(); !errors.Is(err, lock.ErrLeaseLost) {
			t.Fatalf("%s: %v, want ErrLeaseLost", tc.l.Name(), err)
		}
	}
	if err := x.Err(); !strings.Contains(err.Error(), "taken over") {
		t.Fatalf("x: %v; want taken over", err)
	}
	if err := y.Err(); !strings.Contains(err.Error(), "expired") {
		t.Fatalf("y: %v; want expired", err)
	}
	// The client goes on with a new session.
	z, err := a.TryAcquire(ctx, "z")
	if err != nil {
		t.Fatalf("acquiring after the session ended: %v", err)
	}
	if err := z.Check(ctx); err != nil {
		t.Fatal(err)
	}
	if err := x.RunTx(ctx, func(pgx.Tx) error { return nil }); !errors.Is(err, lock.ErrLeaseLost) {
		t.Fatalf("a guarded transaction on the lost lease: %v, want ErrLeaseLost", err)
	}
}

// A force-release reaches its holder at the next renewal, and only the
// lease it freed ends: the session's other leases are kept.
func TestForceReleaseEndsOneLeaseOfTheSession(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	var (
		mu     sync.Mutex
		causes = map[string]lock.LossCause{}
	)
	// A TTL long beside the renewals, so that a loaded machine's stall does
	// not end the session (and y with it) while the test watches.
	a := newClient(t, db, lock.Config{Holder: "a", TTL: 20 * time.Second, RenewInterval: 500 * time.Millisecond, OnEvent: func(e lock.Event) {
		if e.Kind == lock.Lost {
			mu.Lock()
			causes[e.Lease] = e.Cause
			mu.Unlock()
		}
	}})
	x, err := a.TryAcquire(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	y, err := a.TryAcquire(ctx, "y")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.ForceRelease(ctx, db.Pool, db.Schema, "x"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-x.Done():
	case <-ctx.Done():
		t.Fatal("the force-released lease still live")
	}
	r0 := a.Stats().Renewals
	pgtest.Eventually(t, 30*time.Second, "two more renewals, or y ending", func() bool { return a.Stats().Renewals >= r0+2 || y.Err() != nil })
	mu.Lock()
	defer mu.Unlock()
	if causes["x"] != lock.CauseReleasedByOperator || y.Err() != nil || len(causes) != 1 {
		t.Fatalf("after ForceRelease of x: causes %v, y %v; want x released_by_operator, y live", causes, y.Err())
	}
}

// A transaction that holds one lease's row does not hold up the renewal
// of the client's other leases: a revocation of one of them, left open
// (as runner.Seek's transaction is until it commits), while the client
// renews three times and loses nothing; then, committed, it costs that one
// lease only. Before sessions, the renewal updated every lease row and
// waited for the revoking transaction's row lock, and every lease of the
// client ran out of trust behind it.
func TestRenewalDoesNotWaitForALeaseRow(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	var lost atomic.Int64
	// A TTL far above the RenewInterval: a renewal that waited for the
	// lease row would still show, as renewals that stop counting.
	c := newClient(t, db, lock.Config{TTL: 30 * time.Second, RenewInterval: time.Second, OnEvent: func(e lock.Event) {
		if e.Kind == lock.Lost {
			lost.Add(1)
		}
	}})
	const n = 50
	leases := make([]*lock.Lease, n)
	for i := range leases {
		l, err := c.TryAcquire(ctx, fmt.Sprintf("row-%02d", i))
		if err != nil {
			t.Fatal(err)
		}
		leases[i] = l
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, _, err := lock.RevokeTx(ctx, tx, db.Schema, "row-00"); err != nil {
		t.Fatal(err)
	}
	r0 := c.Stats().Renewals
	pgtest.Eventually(t, 20*time.Second, "three renewals while a lease row is locked", func() bool { return c.Stats().Renewals >= r0+3 })
	if got := lost.Load(); got != 0 {
		t.Fatalf("%d leases lost while one lease's row was locked", got)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-leases[0].Done():
	case <-ctx.Done():
		t.Fatal("the revoked lease is still live")
	}
	r1 := c.Stats().Renewals
	pgtest.Eventually(t, 20*time.Second, "two more renewals", func() bool { return c.Stats().Renewals >= r1+2 })
	for _, l := range leases[1:] {
		if err := l.Err(); err != nil {
			t.Fatalf("%s: %v; only the revoked lease should end", l.Name(), err)
		}
	}
	if got := lost.Load(); got != 1 {
		t.Fatalf("%d leases lost, want the revoked one", got)
	}
}

// An acquisition that has to renew the session and whose renewal outlasts
// the trust left (a lock on the session row, a slow server) is not a
// failure the caller sees while its own deadline is far: Acquire tries
// again and returns the lease once the renewal goes through.
func TestAcquireOutlivesASlowRenewal(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	// A TTL far above the 3 s the row stays locked: the session must not
	// expire at the database (by its own clock) inside that window, which
	// would end the lease and let Acquire start a new session.
	a := newClient(t, db, lock.Config{Holder: "a", TTL: 30 * time.Second, RenewInterval: 10 * time.Second, SafetyMargin: 3 * time.Second})
	fake := clock.NewFake(time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))
	a.SetClock(fake)
	if _, err := a.TryAcquire(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, "SELECT 1 FROM "+db.Schema+".pgfence_sessions WHERE holder = 'a' FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	// 0.5 s of trust left by the client's clock: less than a RenewInterval,
	// so the acquisition renews first, under a bound of 0.5 s.
	fake.Advance(26500 * time.Millisecond)
	type result struct {
		l   *lock.Lease
		err error
	}
	got := make(chan result, 1)
	go func() {
		l, err := a.Acquire(ctx, "y")
		got <- result{l, err}
	}()
	// Several of those bounds pass while the row stays locked.
	select {
	case r := <-got:
		t.Fatalf("Acquire returned while the session row was locked, with its deadline far: %v", r.err)
	case <-time.After(3 * time.Second):
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-got:
		if r.err != nil {
			t.Fatalf("Acquire after the session row was unlocked: %v", r.err)
		}
		if err := r.l.Check(ctx); err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("Acquire did not return after the session row was unlocked")
	}
}

// A lease lost between its acquisition and its handing out (expired at the
// database while the acquisition came back) is never handed out, and never
// ends Acquire with an error: Acquire tries again. Four clients acquire and
// release one lease while it is expired under them every few milliseconds;
// a fifth uses TryAcquire, whose only errors are then ErrHeld and
// ErrTryAgain. Events speak only of leases handed out: every Lost or
// Released token was Acquired first.
//
// It runs alone (not parallel): its clients keep both cores busy, which
// would make the parallel tests' renewals late.
func TestAcquireTriesAgainWhenTheLeaseIsLostBeforeItIsHandedOut(t *testing.T) {
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	run, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var (
		wg       sync.WaitGroup
		acquired atomic.Int64
		expired  atomic.Int64
		ended    atomic.Int64 // Lost and Released events
		out      sync.Map     // tokens of Acquired events
	)
	onEvent := func(e lock.Event) {
		switch e.Kind {
		case lock.Acquired:
			out.Store(e.Token, true)
		case lock.Lost, lock.Released:
			ended.Add(1)
			if _, ok := out.Load(e.Token); !ok {
				t.Errorf("%v event for token %d, which was never acquired", e.Kind, e.Token)
			}
		}
	}
	for i := range 4 {
		c := newClient(t, db, lock.Config{Holder: fmt.Sprintf("c%d", i), TTL: 300 * time.Millisecond, RenewInterval: 20 * time.Millisecond, PollInterval: 10 * time.Millisecond, OnEvent: onEvent})
		wg.Add(1)
		go func() {
			defer wg.Done()
			for run.Err() == nil {
				l, err := c.Acquire(run, "churn")
				if err != nil {
					if run.Err() == nil || !errors.Is(err, run.Err()) {
						t.Errorf("Acquire: %v", err)
					}
					return
				}
				acquired.Add(1)
				_ = l.Release(ctx)
			}
		}()
	}
	try := newClient(t, db, lock.Config{Holder: "try", TTL: 300 * time.Millisecond, RenewInterval: 20 * time.Millisecond, PollInterval: 10 * time.Millisecond})
	wg.Add(2)
	go func() {
		defer wg.Done()
		for run.Err() == nil {
			l, err := try.TryAcquire(run, "churn")
			switch {
			case err == nil:
				acquired.Add(1)
				_ = l.Release(ctx)
			case run.Err() != nil:
			case !errors.Is(err, lock.ErrHeld) && !errors.Is(err, lock.ErrTryAgain):
				t.Errorf("TryAcquire: %v", err)
				return
			}
		}
	}()
	go func() {
		defer wg.Done()
		for run.Err() == nil {
			tag, err := db.Pool.Exec(ctx, expiry.SQL(db.Schema), "churn")
			if err != nil {
				t.Errorf("expire: %v", err)
				return
			}
			expired.Add(tag.RowsAffected())
		}
	}()
	wg.Wait()
	t.Logf("acquisitions=%d expiries=%d lost or released=%d", acquired.Load(), expired.Load(), ended.Load())
	if acquired.Load() == 0 || expired.Load() == 0 || ended.Load() == 0 {
		t.Fatalf("nothing exercised: acquisitions=%d expiries=%d", acquired.Load(), expired.Load())
	}
}

// A renewer that cannot open its connection of its own (new connections
// stall: a server whose listen queue overflows, a path that drops SYNs)
// renews over the pool's idle connections meanwhile, and the lease lives;
// once connections open again, the renewer has its own once more, and
// renews on it while every pooled connection is held.
func TestRenewalsGoOnWhileTheRenewersConnectionCannotOpen(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	var (
		stalled   atomic.Bool
		unstalled = make(chan struct{})
		dials     atomic.Int64 // while stalled
	)
	pool := pgtest.NewPool(t, pgtest.UniqueName("stalled"), func(c *pgxpool.Config) {
		c.MaxConns = 4
		c.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error {
			if !stalled.Load() {
				return nil
			}
			dials.Add(1)
			select { // a connect that does not complete while stalled
			case <-unstalled:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	})
	// The pool's connections open and idle before new ones stall.
	var warm []*pgxpool.Conn
	for range pool.Config().MaxConns {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		warm = append(warm, conn)
	}
	for _, conn := range warm {
		conn.Release()
	}
	logs := pgtest.NewLogs()
	logs.LogOnFailure(t)
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, TTL: 6 * time.Second, RenewInterval: time.Second, Logger: slog.New(logs)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	stalled.Store(true)
	l, err := c.TryAcquire(ctx, "stalled")
	if err != nil {
		t.Fatal(err)
	}
	// Six renewals: a TTL's worth of intervals, past the trust window of
	// the session's start.
	before := c.Stats().Renewals
	pgtest.Eventually(t, 30*time.Second, "six renewals while new connections stall", func() bool {
		return c.Stats().Renewals-before >= 6 || l.Err() != nil
	})
	if err := l.Err(); err != nil {
		t.Fatalf("the lease ended while only new connections stalled: %v", err)
	}
	if dials.Load() == 0 {
		t.Fatal("no connect was tried while stalled: the renewer's own connection was open already, so the stall was not tested")
	}
	// Connections open again; the renewer's connect in flight completes.
	// Every pooled connection held, the renewals go on over its own.
	stalled.Store(false)
	close(unstalled)
	var held []*pgxpool.Conn
	defer func() {
		for _, conn := range held {
			conn.Release()
		}
	}()
	for range pool.Config().MaxConns {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, conn)
	}
	before = c.Stats().Renewals
	pgtest.Eventually(t, 30*time.Second, "three renewals with every pooled connection held", func() bool {
		return c.Stats().Renewals-before >= 3 || l.Err() != nil
	})
	if err := l.Err(); err != nil {
		t.Fatalf("the lease ended while the pool was held: %v", err)
	}
}

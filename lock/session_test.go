package lock_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgfence/pgfence/internal/clock"
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
	c := newClient(t, db, lock.Config{TTL: 3 * time.Second})
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
		var pid int
		if err := renewal.QueryRow(ctx, "UPDATE "+db.Schema+".pgfence_sessions SET expires_at = now() + interval '1 hour' WHERE id = "+
			session+" RETURNING pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		b := newClient(t, db, lock.Config{Holder: "b"})
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
	a := newClient(t, db, lock.Config{Holder: "a", TTL: 3 * time.Second, OnEvent: func(e lock.Event) {
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
	if _, _, err := lock.ForceRelease(ctx, db.Pool, db.Schema, "x"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-x.Done():
	case <-ctx.Done():
		t.Fatal("the force-released lease still live")
	}
	r0 := a.Stats().Renewals
	pgtest.Eventually(t, 30*time.Second, "two more renewals", func() bool { return a.Stats().Renewals >= r0+2 })
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
	c := newClient(t, db, lock.Config{TTL: 3 * time.Second, OnEvent: func(e lock.Event) {
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

package lock_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// Acquire with Defer leaves a freed lease to a campaigner that does not
// defer, and takes it itself when no one else does. The deferral (5 s) is
// the margin the campaigner that does not defer has to take the lease, so
// that a loaded machine does not decide the order.
func TestDeferLeavesAFreedLeaseToOthers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	h, p, q := newClient(t, db, lock.Config{Holder: "h"}), newClient(t, db, lock.Config{Holder: "p"}), newClient(t, db, lock.Config{Holder: "q"})
	held, err := h.TryAcquire(ctx, "preferred")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *lock.Lease, 2)
	// q, which defers, waits first (the poller has marked the held lease
	// waited for) before p starts. Its attempts carry the deferral, so a
	// release landing between its look at the lease and an attempt is not
	// taken at once either (it was, twice, under load, before the attempt
	// carried it).
	go func() {
		l, err := q.Acquire(ctx, "preferred", lock.Defer(func() time.Duration { return 5 * time.Second }))
		if err == nil {
			got <- l
		}
	}()
	waited := "SELECT waiters_until IS NOT NULL FROM " + pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize() + " WHERE name = 'preferred'"
	pgtest.Eventually(t, 30*time.Second, "q waiting", func() bool {
		var ok bool
		return db.Pool.QueryRow(ctx, waited).Scan(&ok) == nil && ok
	})
	go func() {
		l, err := p.Acquire(ctx, "preferred")
		if err == nil {
			got <- l
		}
	}()
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	first := <-got
	if first.Holder() != "p" {
		t.Fatalf("%s took the freed lease; the one that does not defer should have", first.Holder())
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if second := <-got; second.Holder() != "q" {
		t.Fatalf("then %s took it, want q", second.Holder())
	}
}

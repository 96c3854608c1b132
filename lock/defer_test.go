package lock_test

import (
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// Acquire with Defer leaves a freed lease to a campaigner that does not
// defer, and takes it itself when no one else does.
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
	go func() {
		l, err := q.Acquire(ctx, "preferred", lock.Defer(func() time.Duration { return time.Second }))
		if err == nil {
			got <- l
		}
	}()
	go func() {
		l, err := p.Acquire(ctx, "preferred")
		if err == nil {
			got <- l
		}
	}()
	time.Sleep(300 * time.Millisecond) // both wait
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

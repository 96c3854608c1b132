package lock_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// Every entry point that takes a context refuses a nil one with
// fence.ErrNilContext, naming the call, and changes nothing. Formerly each
// panicked inside pgx (Observe in a goroutine of its own, taking the
// process down), and Close(nil) marked the client closed before panicking.
func TestNilContext(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c := newClient(t, db, lock.Config{})
	l, err := c.TryAcquire(ctx, "held")
	if err != nil {
		t.Fatal(err)
	}
	e := &lock.Election{Client: c, Name: "elected", Lead: func(context.Context, *lock.Lease) error { return nil }}
	var nilCtx context.Context
	calls := []struct {
		op   string
		call func() error
	}{
		{"TryAcquire", func() error { _, err := c.TryAcquire(nilCtx, "free"); return err }},
		{"Acquire", func() error { _, err := c.Acquire(nilCtx, "free"); return err }},
		{"Leases", func() error { _, err := lock.Leases(nilCtx, c.Pool(), c.Config().Schema); return err }},
		{"Inspect", func() error { _, err := lock.Inspect(nilCtx, c.Pool(), c.Config().Schema, "held"); return err }},
		{"ForceRelease", func() error { _, err := lock.ForceRelease(nilCtx, c.Pool(), c.Config().Schema, "held"); return err }},
		{"Observe", func() error { _, err := c.Observe(nilCtx, "held"); return err }},
		{"Election.Run", func() error { return e.Run(nilCtx) }},
		{"Lease.Check", func() error { return l.Check(nilCtx) }},
		{"Lease.RunTx", func() error { return l.RunTx(nilCtx, func(pgx.Tx) error { return nil }) }},
		{"Lease.Release", func() error { return l.Release(nilCtx) }},
		{"Close", func() error { return c.Close(nilCtx) }},
	}
	for _, tc := range calls {
		err := pgtest.NoPanic(tc.call)
		if !errors.Is(err, fence.ErrNilContext) || !strings.HasPrefix(err.Error(), "lock: "+tc.op+": ") {
			t.Errorf("%s with a nil context: %v; want \"lock: %s: \" and fence.ErrNilContext", tc.op, err, tc.op)
		}
	}
	if l, ok := lock.FromContext(nilCtx); ok || l != nil {
		t.Errorf("FromContext(nil) = %v, %v; want no lease", l, ok)
	}

	// Nothing happened: the lease is still held, the client still open.
	if err := l.Check(ctx); err != nil {
		t.Fatalf("the lease after the calls with a nil context: %v", err)
	}
	if _, err := c.TryAcquire(ctx, "free"); err != nil {
		t.Fatalf("TryAcquire after Close(nil): %v", err)
	}
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if info, err := lock.Inspect(ctx, c.Pool(), c.Config().Schema, "held"); err != nil || info.Held {
		t.Fatalf("after Close: %+v, %v; want the lease freed", info, err)
	}
}

package lock

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A renewal pass is late when one of its statements still to send would
// come back with less than RenewInterval of its leases' trust left.
func TestLate(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(ds ...time.Duration) []time.Time {
		var ts []time.Time
		for _, d := range ds {
			ts = append(ts, now.Add(d))
		}
		return ts
	}
	ms := time.Millisecond
	for _, c := range []struct {
		name   string
		firsts []time.Time
		took   time.Duration
		want   bool
	}{
		{"on time, TTL 3s: 1.7s left", at(1700 * ms), 50 * ms, false},
		{"the first statement comes back with 1s left", at(1050 * ms), 50 * ms, false},
		{"the first statement comes back with less than 1s", at(1049 * ms), 50 * ms, true},
		{"already out of trust", at(-ms), 50 * ms, true},
		{"three statements, the last comes back with 1s left", at(1700*ms, 1800*ms, 2000*ms), 333 * ms, false},
		{"three statements, the last comes back late", at(1700*ms, 1800*ms, 1900*ms), 333 * ms, true},
		{"nothing to send", nil, time.Second, false},
	} {
		if got := late(c.firsts, now, c.took, time.Second); got != c.want {
			t.Errorf("%s: late = %v, want %v", c.name, got, c.want)
		}
	}
}

// The gate lets acquisitions through while open, holds them while shut
// (counting each), releases them all when it opens, and gives up with the
// context's error.
func TestGate(t *testing.T) {
	var g gate
	ctx := context.Background()
	if err := g.pass(ctx); err != nil || g.waits.Load() != 0 {
		t.Fatalf("an open gate: %v, %d waits", err, g.waits.Load())
	}
	g.shut()
	g.shut() // shutting a shut gate changes nothing
	done := make(chan error, 2)
	for range 2 {
		go func() { done <- g.pass(ctx) }()
	}
	for g.waits.Load() < 2 {
		time.Sleep(time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("passed a shut gate: %v", err)
	default:
	}
	g.open()
	for range 2 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	g.open() // opening an open gate changes nothing
	g.shut()
	short, cancel := context.WithCancel(ctx)
	cancel()
	if err := g.pass(short); !errors.Is(err, context.Canceled) {
		t.Fatalf("a shut gate, the context ended: %v", err)
	}
	if n := g.waits.Load(); n != 3 {
		t.Fatalf("%d waits counted, want 3", n)
	}
}

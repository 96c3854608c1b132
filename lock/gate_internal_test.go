package lock

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
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
		if got := late(c.firsts, now, c.took, time.Second); got != c.want { // slack 1s
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
	if waited, err := g.pass(ctx); waited || err != nil || g.waits.Load() != 0 {
		t.Fatalf("an open gate: waited %v, %v, %d waits", waited, err, g.waits.Load())
	}
	g.shut()
	g.shut() // shutting a shut gate changes nothing
	done := make(chan error, 2)
	for range 2 {
		go func() {
			waited, err := g.pass(ctx)
			if err == nil && !waited {
				err = errors.New("passed a shut gate without waiting")
			}
			done <- err
		}()
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
	if _, err := g.pass(short); !errors.Is(err, context.Canceled) {
		t.Fatalf("a shut gate, the context ended: %v", err)
	}
	if n := g.waits.Load(); n != 3 {
		t.Fatalf("%d waits counted, want 3", n)
	}
}

// The slack a renewal must leave is at most RenewInterval and at most half
// of what a renewal on time leaves, so that no valid configuration is late
// at every pass.
func TestLateSlack(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want time.Duration
	}{
		{Config{TTL: 3 * time.Second}, 850 * time.Millisecond},   // on time: 1.7s left
		{Config{TTL: 15 * time.Second}, 4250 * time.Millisecond}, // on time: 8.5s left
		{Config{TTL: 30 * time.Second, RenewInterval: 2 * time.Second}, 2 * time.Second},
		{Config{TTL: 10 * time.Second, RenewInterval: 5 * time.Second}, 2 * time.Second}, // on time: 4s left
	} {
		cfg := c.cfg.withDefaults()
		if err := cfg.validate(); err != nil {
			t.Fatal(err)
		}
		w := cfg.window()
		if got := w.lateSlack(); got != c.want {
			t.Errorf("TTL %v, RenewInterval %v: slack %v, want %v", cfg.TTL, cfg.RenewInterval, got, c.want)
		}
		onTime := cfg.TTL - cfg.SafetyMargin - cfg.RenewInterval
		var sent time.Time // the last renewal's send
		if late([]time.Time{w.until(sent)}, sent.Add(cfg.RenewInterval+onTime/4), 0, w.lateSlack()) {
			t.Errorf("TTL %v, RenewInterval %v: a pass a quarter of its headroom behind is late", cfg.TTL, cfg.RenewInterval)
		}
	}
}

// A late period is logged once when it starts and once when the passes
// have been on time onTimeAgain times in a row.
func TestLatenessLogsOncePerPeriod(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	var l lateness
	for _, late := range []bool{false, true, true, false, false, true, false, false, false, false, true} {
		l.pass(log, late, 100000, time.Second)
	}
	if w, i := strings.Count(buf.String(), "renewals are late"), strings.Count(buf.String(), "on time again"); w != 2 || i != 1 {
		t.Fatalf("%d warnings and %d recoveries logged, want 2 and 1:\n%s", w, i, buf.String())
	}
}

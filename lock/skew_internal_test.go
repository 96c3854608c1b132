package lock

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/idleholder"
)

// The warning fires once when the skew is surely past SkewWarning, not again
// while it stays there, and notes once that it is back under; a large
// difference explained by a slow round trip does not cross.
func TestSkewWarningOnCrossings(t *testing.T) {
	var logged bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logged, nil))
	c := &Client{cfg: Config{SkewWarning: 50 * time.Millisecond, Logger: log}, log: log}
	count := func(level, msg string) int {
		n := 0
		for _, line := range strings.Split(logged.String(), "\n") {
			if strings.Contains(line, "level="+level) && strings.Contains(line, msg) {
				n++
			}
		}
		return n
	}
	sent := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	renew := func(rtt, db time.Duration) {
		c.stats.observe(sent, sent.Add(rtt), sent.Add(db))
		c.watchSkew()
	}
	ms := time.Millisecond
	renew(300*ms, 250*ms) // 250 ms off, all of it within the round trip
	if n := count("WARN", "SkewWarning"); n != 0 {
		t.Fatalf("%d warnings for a difference the round trip explains, want 0", n)
	}
	renew(10*ms, 200*ms)  // surely 190 ms ahead: warns
	renew(10*ms, 300*ms)  // still over: no second warning
	renew(10*ms, -200*ms) // over, the other way: still no second warning
	if n := count("WARN", "SkewWarning"); n != 1 {
		t.Fatalf("%d warnings, want 1", n)
	}
	renew(10*ms, 5*ms) // agrees within the round trip: back under
	renew(10*ms, 5*ms)
	if n := count("INFO", "back under"); n != 1 {
		t.Fatalf("%d notes of the skew back under, want 1", n)
	}
	renew(10*ms, 200*ms) // a new crossing warns again
	if n := count("WARN", "SkewWarning"); n != 2 {
		t.Fatalf("%d warnings after a second crossing, want 2", n)
	}
	c.cfg.SkewWarning = -1 // never warn
	renew(10*ms, 5*ms)
	renew(10*ms, time.Hour)
	if n := count("WARN", "SkewWarning"); n != 2 {
		t.Fatalf("%d warnings with warnings off, want still 2", n)
	}
}

// The idle-holder threshold follows PollInterval, within its floor and
// its ceiling (TTL / 10, at most 1 s).
func TestIdleHolderAfterFollowsPollInterval(t *testing.T) {
	ms := time.Millisecond
	for _, tc := range []struct {
		ttl, poll, want time.Duration
	}{
		{15 * time.Second, time.Second, 250 * ms},    // the defaults
		{15 * time.Second, 200 * ms, 50 * ms},        // a quarter of PollInterval
		{15 * time.Second, 20 * ms, 10 * ms},         // the floor
		{time.Minute, 10 * time.Second, time.Second}, // the ceiling
		{time.Second, time.Second, 100 * ms},         // TTL / 10 below a quarter of PollInterval
	} {
		if got := idleholder.DefaultAfter(tc.ttl, tc.poll); got != tc.want {
			t.Errorf("TTL %v, PollInterval %v: %v, want %v", tc.ttl, tc.poll, got, tc.want)
		}
	}
	if got := (Config{}).withDefaults().IdleHolderAfter; got != 250*ms {
		t.Errorf("default IdleHolderAfter %v, want 250ms", got)
	}
	if got := (Config{IdleHolderAfter: -1}).withDefaults().IdleHolderAfter; got >= 0 {
		t.Errorf("a negative IdleHolderAfter became %v; it means never", got)
	}
}

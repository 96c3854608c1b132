package lock

import (
	"testing"
	"time"
)

// The trust window's arithmetic, with the default timings (TTL 15s,
// SafetyMargin 1.5s, RenewInterval 5s): no database, no clock.
func TestTrustWindow(t *testing.T) {
	w := Config{}.withDefaults().window()
	t0 := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	if got := w.until(t0); !got.Equal(at(13500 * time.Millisecond)) {
		t.Fatalf("until = %v, want send + TTL - SafetyMargin", got)
	}
	for _, tc := range []struct {
		name               string
		ttl, margin, renew time.Duration
		slack              time.Duration
	}{
		{"defaults: half the headroom", 15 * time.Second, 1500 * time.Millisecond, 5 * time.Second, 4250 * time.Millisecond},
		{"3s TTL: half the headroom", 3 * time.Second, 300 * time.Millisecond, time.Second, 850 * time.Millisecond},
		{"long TTL: a RenewInterval", 60 * time.Second, time.Second, 5 * time.Second, 5 * time.Second},
	} {
		if got := (window{ttl: tc.ttl, margin: tc.margin, renew: tc.renew}).lateSlack(); got != tc.slack {
			t.Errorf("lateSlack, %s: %v, want %v", tc.name, got, tc.slack)
		}
	}
	cur := w.until(at(5 * time.Second))
	if got := w.extend(cur, at(10*time.Second)); !got.Equal(w.until(at(10 * time.Second))) {
		t.Errorf("extend by a later renewal: %v", got)
	}
	if got := w.extend(cur, at(time.Second)); !got.Equal(cur) {
		t.Errorf("extend by an earlier renewal's late reply moved the window back: %v, want %v", got, cur)
	}
}

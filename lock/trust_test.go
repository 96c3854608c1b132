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
		name      string
		sent, now time.Duration
		late      bool
	}{
		{"reply at once", 0, 10 * time.Millisecond, false},
		{"reply after 8.5s: exactly RenewInterval left", 0, 8500 * time.Millisecond, false},
		{"reply after 8.6s: less than RenewInterval left", 0, 8600 * time.Millisecond, true},
		{"reply after the window", 0, 20 * time.Second, true},
	} {
		if got := w.lateGrant(at(tc.sent), at(tc.now)); got != tc.late {
			t.Errorf("lateGrant, %s: %v, want %v", tc.name, got, tc.late)
		}
	}
	for _, tc := range []struct {
		name   string
		since  time.Time
		now    time.Duration
		adopts bool
	}{
		{"no attempt before", time.Time{}, time.Second, false},
		{"found at once", t0, time.Second, true},
		{"half a RenewInterval and a bit left", t0, 10999 * time.Millisecond, true},
		{"exactly half a RenewInterval left", t0, 11 * time.Second, false},
		{"past the window", t0, 14 * time.Second, false},
	} {
		if got := w.adoptable(tc.since, at(tc.now)); got != tc.adopts {
			t.Errorf("adoptable, %s: %v, want %v", tc.name, got, tc.adopts)
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

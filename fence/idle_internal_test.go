package fence

import (
	"math"
	"testing"
	"time"
)

// Guard.IdleTimeout and Resource.IdleTimeout follow one rule: 0 is the
// type's default (a guard's: none; a resource's: DefaultIdleTimeout),
// negative is none, positive is the bound, clamped to what the server takes.
func TestIdleTimeoutOneRule(t *testing.T) {
	for _, tc := range []struct {
		what      string
		guard, rs int64 // the milliseconds a Guard and a Resource send
		d         time.Duration
	}{
		{"zero: the default", 0, DefaultIdleTimeout.Milliseconds(), 0},
		{"negative: none", 0, 0, -time.Second},
		{"positive: the bound", 2000, 2000, 2 * time.Second},
		{"under a millisecond: one", 1, 1, time.Microsecond},
		{"past INT_MAX ms: INT_MAX", math.MaxInt32, math.MaxInt32, 1000 * time.Hour},
	} {
		if got := (Guard{IdleTimeout: tc.d}).idleMillis(); got != tc.guard {
			t.Errorf("%s: a Guard sends %d ms, want %d", tc.what, got, tc.guard)
		}
		if got := idleMillis(tc.d, DefaultIdleTimeout); got != tc.rs {
			t.Errorf("%s: a Resource sends %d ms, want %d", tc.what, got, tc.rs)
		}
	}
}

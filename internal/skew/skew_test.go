package skew

import (
	"testing"
	"time"
)

// The skew a renewal proves is the part of the database's clock reading
// that no timing within the round trip explains.
func TestOf(t *testing.T) {
	sent := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	ms := time.Millisecond
	for _, c := range []struct {
		name            string
		rtt, db         time.Duration // the round trip, and dbNow - sent
		estimate, least time.Duration
	}{
		{"same clock, read at the start", 100 * ms, 0, -50 * ms, 0},
		{"same clock, read at the end", 100 * ms, 100 * ms, 50 * ms, 0},
		{"same clock, read midway", 100 * ms, 50 * ms, 0, 0},
		{"database ahead by more than the round trip", 100 * ms, 300 * ms, 250 * ms, 200 * ms},
		{"database behind", 100 * ms, -300 * ms, -350 * ms, 300 * ms},
		{"an instant round trip", 0, 70 * ms, 70 * ms, 70 * ms},
	} {
		estimate, least := Of(sent, sent.Add(c.rtt), sent.Add(c.db))
		if estimate != c.estimate || least != c.least {
			t.Errorf("%s: Of = %v, %v; want %v, %v", c.name, estimate, least, c.estimate, c.least)
		}
	}
}

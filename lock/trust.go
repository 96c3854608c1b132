package lock

import "time"

// window is the trust-window arithmetic of a client's leases: pure
// functions of the lease timings and the times they are given (send times
// and "now" on the monotonic clock), so that they are tested without a
// database or a clock.
//
// A holder trusts a lease until the time its last successful acquisition or
// renewal was sent + TTL - SafetyMargin: the database cannot have let anyone
// else acquire before then, whatever the reply's delay.
type window struct {
	ttl, margin, renew time.Duration
}

func (c Config) window() window {
	return window{ttl: c.TTL, margin: c.SafetyMargin, renew: c.RenewInterval}
}

// until is the end of the trust window of a statement sent at sent.
func (w window) until(sent time.Time) time.Time { return sent.Add(w.ttl - w.margin) }

// lateSlack is how much of the session's trust window a renewal must
// leave to be on time (Health): a renewal on time leaves TTL -
// SafetyMargin - RenewInterval (with the defaults, 1.7 RenewIntervals); one
// that leaves less than half of that, or less than one RenewInterval, is
// late.
func (w window) lateSlack() time.Duration { return min(w.renew, (w.ttl-w.margin-w.renew)/2) }

// extend returns the trust deadline after a renewal sent at sent: the later
// of the current deadline and the renewal's (a renewal's reply can arrive
// after a later one's: the window never moves back).
func (w window) extend(current, sent time.Time) time.Time {
	if until := w.until(sent); until.After(current) {
		return until
	}
	return current
}

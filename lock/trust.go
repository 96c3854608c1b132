package lock

import "time"

// window is the trust-window arithmetic, pure functions of the timings
// (tested without a database or a clock): a holder trusts its leases until
// its last successful renewal was sent + TTL - SafetyMargin.
type window struct {
	ttl, margin, renew time.Duration
}

func (c Config) window() window {
	return window{ttl: c.TTL, margin: c.SafetyMargin, renew: c.RenewInterval}
}

// until is the end of the trust window of a statement sent at sent.
func (w window) until(sent time.Time) time.Time { return sent.Add(w.ttl - w.margin) }

// lateSlack is the trust a renewal must leave to be on time (Health): half
// of what one on time leaves, at most a RenewInterval.
func (w window) lateSlack() time.Duration { return min(w.renew, (w.ttl-w.margin-w.renew)/2) }

// extend returns the trust deadline after a renewal sent at sent: the window
// never moves back.
func (w window) extend(current, sent time.Time) time.Time {
	if until := w.until(sent); until.After(current) {
		return until
	}
	return current
}

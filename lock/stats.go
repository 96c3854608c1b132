package lock

import (
	"sync/atomic"
	"time"
)

// Stats is a snapshot of a client's lease health, for metrics and alerts.
type Stats struct {
	// Held is the number of leases the client holds now.
	Held int
	// Renewals and RenewalFailures count the renewals of the client's
	// session (one statement per RenewInterval, whatever the number of
	// leases) that succeeded and failed.
	Renewals, RenewalFailures uint64
	// LastRenewLatency is the round trip of the last successful renewal.
	LastRenewLatency time.Duration
	// SlowRenewals counts renewals that took more than half of
	// RenewInterval: a server or network too slow for the TTL.
	SlowRenewals uint64
	// IdleHoldersEnded counts the sessions the client's acquisitions
	// ended (Config.IdleHolderAfter); IdleHolderLooks, the looks for them
	// begun; IdleHolderLookErrors, those that failed.
	IdleHoldersEnded, IdleHolderLooks, IdleHolderLookErrors uint64
	// ClockSkew estimates the database's clock minus this machine's at
	// the last successful renewal, to within half of LastRenewLatency.
	ClockSkew time.Duration
}

type stats struct {
	renewals, failures atomic.Uint64
	latency, skew      atomic.Int64
	// leastSkew is the smallest skew (in absolute value) the last renewal
	// is consistent with: 0 when the clocks may agree.
	leastSkew atomic.Int64
	skewed    atomic.Bool // leastSkew is past Config.SkewWarning
	slow      atomic.Uint64
	renewSlow atomic.Bool // the last renewal was slow
	idleEnded atomic.Uint64
	// idleLooks, idleLookErrors: looks for idle holders begun, failed.
	idleLooks, idleLookErrors atomic.Uint64
}

// Stats returns the client's current lease health.
func (c *Client) Stats() Stats {
	held := 0
	if s, _ := c.state(); s != nil {
		held = s.count()
	}
	return Stats{
		Held:                 held,
		Renewals:             c.stats.renewals.Load(),
		RenewalFailures:      c.stats.failures.Load(),
		LastRenewLatency:     time.Duration(c.stats.latency.Load()),
		SlowRenewals:         c.stats.slow.Load(),
		IdleHoldersEnded:     c.stats.idleEnded.Load(),
		IdleHolderLooks:      c.stats.idleLooks.Load(),
		IdleHolderLookErrors: c.stats.idleLookErrors.Load(),
		ClockSkew:            time.Duration(c.stats.skew.Load()),
	}
}

// observe records a successful renewal and returns its round trip.
func (s *stats) observe(sent, got, dbNow time.Time) time.Duration {
	rtt := got.Sub(sent)
	estimate, least := skewOf(sent, got, dbNow)
	s.renewals.Add(1)
	s.latency.Store(int64(rtt))
	s.skew.Store(int64(estimate))
	s.leastSkew.Store(int64(least))
	return rtt
}

// skewOf judges the database's clock against this machine's from a
// statement sent at sent, answered at got, that read dbNow: the skew lies
// between dbNow-got and dbNow-sent. estimate is the middle, least the
// smallest in absolute value (0 when the clocks may agree: a slow round
// trip is not skew).
func skewOf(sent, got, dbNow time.Time) (estimate, least time.Duration) {
	rtt := got.Sub(sent)
	lo, hi := dbNow.Sub(sent.Add(rtt)), dbNow.Sub(sent) // dbNow-got, dbNow-sent on one clock reading
	estimate = lo + (hi-lo)/2
	switch {
	case lo > 0:
		least = lo
	case hi < 0:
		least = -hi
	}
	return estimate, least
}

// watchSkew logs once when the skew is surely past Config.SkewWarning,
// and once when it may be back under.
func (c *Client) watchSkew() {
	if c.cfg.SkewWarning < 0 {
		return
	}
	skew := time.Duration(c.stats.skew.Load())
	over := time.Duration(c.stats.leastSkew.Load()) > c.cfg.SkewWarning
	if c.stats.skewed.Swap(over) == over {
		return
	}
	if over {
		c.log.Warn("pgfence: the database's clock and this machine's differ by more than SkewWarning; "+
			"expiry is judged by the database, but the skew eats into SafetyMargin", "skew", skew,
			"at_least", time.Duration(c.stats.leastSkew.Load()), "round_trip", time.Duration(c.stats.latency.Load()),
			"warning", c.cfg.SkewWarning, "safety_margin", c.cfg.SafetyMargin)
	} else {
		c.log.Info("pgfence: clock skew back under SkewWarning", "skew", skew)
	}
}

// TimeLeft returns how long the lease can still be trusted without another
// successful renewal (0 once it has ended).
func (l *Lease) TimeLeft() time.Duration {
	if l.Err() != nil {
		return 0
	}
	return max(l.TrustedUntil().Sub(l.c.clock.Now()), 0)
}

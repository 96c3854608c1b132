package lock

import (
	"sync/atomic"
	"time"
)

// Stats is a snapshot of a client's lease health, for metrics and alerts.
type Stats struct {
	// Held is the number of leases the client holds now.
	Held int
	// Renewals and RenewalFailures count renewal statements (one per
	// interval for all leases) that succeeded and failed.
	Renewals, RenewalFailures uint64
	// LastRenewLatency is the round trip of the last successful renewal.
	LastRenewLatency time.Duration
	// ClockSkew estimates the database's clock minus this machine's, from
	// the last successful renewal (server time against the midpoint of the
	// request). pgfence never uses it for decisions (expiry is judged by
	// the database); a large value points at a misconfigured clock.
	ClockSkew time.Duration
}

type stats struct {
	renewals, failures atomic.Uint64
	latency, skew      atomic.Int64
	skewed             atomic.Bool // the skew is past Config.SkewWarning
}

// Stats returns the client's current lease health.
func (c *Client) Stats() Stats {
	c.mu.Lock()
	held := len(c.held)
	c.mu.Unlock()
	return Stats{
		Held:             held,
		Renewals:         c.stats.renewals.Load(),
		RenewalFailures:  c.stats.failures.Load(),
		LastRenewLatency: time.Duration(c.stats.latency.Load()),
		ClockSkew:        time.Duration(c.stats.skew.Load()),
	}
}

// observe records a successful renewal sent at sent whose reply arrived at
// got, with the database's statement time dbNow, and returns its round trip.
func (s *stats) observe(sent, got, dbNow time.Time) time.Duration {
	rtt := got.Sub(sent)
	s.renewals.Add(1)
	s.latency.Store(int64(rtt))
	s.skew.Store(int64(dbNow.Sub(sent.Add(rtt / 2))))
	return rtt
}

// watchSkew logs once when the estimated clock skew crosses
// Config.SkewWarning, and once when it is back under.
func (c *Client) watchSkew() {
	if c.cfg.SkewWarning < 0 {
		return
	}
	skew := time.Duration(c.stats.skew.Load())
	over := skew > c.cfg.SkewWarning || -skew > c.cfg.SkewWarning
	if c.stats.skewed.Swap(over) == over {
		return
	}
	if over {
		c.cfg.Logger.Warn("pgfence: the database's clock and this machine's differ by more than SkewWarning; "+
			"expiry is judged by the database, but the skew eats into SafetyMargin", "skew", skew,
			"warning", c.cfg.SkewWarning, "safety_margin", c.cfg.SafetyMargin, "holder", c.cfg.Holder)
	} else {
		c.cfg.Logger.Info("pgfence: clock skew back under SkewWarning", "skew", skew, "holder", c.cfg.Holder)
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

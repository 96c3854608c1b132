package lock

import (
	"sync/atomic"
	"time"

	"github.com/pgfence/pgfence/internal/skew"
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
	latency            atomic.Int64
	skew               skew.Gauge // judged at each renewal
	slow               atomic.Uint64
	renewSlow          atomic.Bool // the last renewal was slow
	idleEnded          atomic.Uint64
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
		ClockSkew:            c.stats.skew.Estimate(),
	}
}

// observe records a successful renewal and returns its round trip.
func (s *stats) observe(sent, got, dbNow time.Time) time.Duration {
	rtt := got.Sub(sent)
	s.renewals.Add(1)
	s.latency.Store(int64(rtt))
	s.skew.Observe(sent, got, dbNow)
	return rtt
}

// watchSkew logs once when the skew is surely past Config.SkewWarning,
// and once when it may be back under.
func (c *Client) watchSkew() {
	if c.cfg.SkewWarning < 0 {
		return
	}
	over, changed := c.stats.skew.Crossed(c.cfg.SkewWarning)
	if !changed {
		return
	}
	est := c.stats.skew.Estimate()
	if over {
		c.log.Warn("pgfence: the database's clock and this machine's differ by more than SkewWarning; "+
			"expiry is judged by the database, but the skew eats into SafetyMargin", "skew", est,
			"at_least", c.stats.skew.Least(), "round_trip", time.Duration(c.stats.latency.Load()),
			"warning", c.cfg.SkewWarning, "safety_margin", c.cfg.SafetyMargin)
	} else {
		c.log.Info("pgfence: clock skew back under SkewWarning", "skew", est)
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

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
// got, with the database's statement time dbNow.
func (s *stats) observe(sent, got, dbNow time.Time) {
	rtt := got.Sub(sent)
	s.renewals.Add(1)
	s.latency.Store(int64(rtt))
	s.skew.Store(int64(dbNow.Sub(sent.Add(rtt / 2))))
}

// TimeLeft returns how long the lease can still be trusted without another
// successful renewal (0 once it has ended).
func (l *Lease) TimeLeft() time.Duration {
	if l.Err() != nil {
		return 0
	}
	return max(time.Until(l.TrustedUntil()), 0)
}

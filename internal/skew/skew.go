// Package skew judges the database's clock against this machine's from the
// round trip of a statement that read it: the skew lies between what the
// database read minus when the answer came and minus when the statement
// was sent. A slow round trip is not skew.
package skew

import (
	"sync/atomic"
	"time"
)

// Of judges a statement sent at sent, answered at got, that read dbNow:
// estimate is the middle of the range the skew lies in, least its smallest
// value in absolute terms (0 when the clocks may agree).
func Of(sent, got, dbNow time.Time) (estimate, least time.Duration) {
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

// Gauge keeps the last judgement for concurrent readers, and tells when it
// crosses a limit. The zero value is ready to use.
type Gauge struct {
	estimate, least atomic.Int64
	over            atomic.Bool // the last Crossed found least past its limit
}

// Observe judges a statement (Of) and keeps the judgement.
func (g *Gauge) Observe(sent, got, dbNow time.Time) {
	estimate, least := Of(sent, got, dbNow)
	g.estimate.Store(int64(estimate))
	g.least.Store(int64(least))
}

// Estimate is the last judgement's estimate (Of).
func (g *Gauge) Estimate() time.Duration { return time.Duration(g.estimate.Load()) }

// Least is the last judgement's smallest skew (Of).
func (g *Gauge) Least() time.Duration { return time.Duration(g.least.Load()) }

// Crossed reports whether the last judgement is surely past limit, and
// whether that changed since the last call.
func (g *Gauge) Crossed(limit time.Duration) (over, changed bool) {
	over = g.Least() > limit
	return over, g.over.Swap(over) != over
}

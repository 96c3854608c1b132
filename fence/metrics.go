package fence

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgfence/pgfence/internal/buckets"
	"github.com/pgfence/pgfence/internal/errtype"
)

// Metrics records what guards refuse and commit (README's "Metrics"). Build
// one with NewMetrics and set it on a Guard; a Guard without one uses
// instruments from the global MeterProvider (otel.SetMeterProvider), which
// are no-ops until the application installs an OpenTelemetry SDK.
// lock.Lease.Guard sets the lock client's.
type Metrics struct {
	transactions metric.Int64Counter
	check        metric.Float64Histogram
}

// NewMetrics returns the fence instruments of mp.
func NewMetrics(mp metric.MeterProvider) (*Metrics, error) {
	m := mp.Meter("github.com/pgfence/pgfence/fence")
	tx, err := m.Int64Counter("pgfence.guard.transactions", metric.WithUnit("{transaction}"),
		metric.WithDescription("Guarded transactions and checks, by pgfence.outcome: committed, stale (refused: no longer the holder), outcome_unknown, error (with error.type: the SQLSTATE, timeout, canceled, connection or _OTHER)."))
	if err != nil {
		return nil, fmt.Errorf("fence: metrics: %w", err)
	}
	check, err := m.Float64Histogram("pgfence.guard.check.duration", metric.WithUnit("s"),
		metric.WithDescription("Round trip of a fence check sent on its own (Guard.Check, Resource.Admit); a pipelined check rides with the first statement."),
		metric.WithExplicitBucketBoundaries(buckets.Latency...))
	if err != nil {
		return nil, fmt.Errorf("fence: metrics: %w", err)
	}
	return &Metrics{transactions: tx, check: check}, nil
}

var (
	outcomeCommitted = metric.WithAttributeSet(attribute.NewSet(attribute.String("pgfence.outcome", "committed")))
	outcomeStale     = metric.WithAttributeSet(attribute.NewSet(attribute.String("pgfence.outcome", "stale")))
	outcomeUnknown   = metric.WithAttributeSet(attribute.NewSet(attribute.String("pgfence.outcome", "outcome_unknown")))

	globalOnce    sync.Once
	globalMetrics *Metrics
)

// metrics returns g's instruments, or the global provider's.
func (g Guard) metrics() *Metrics {
	if g.Metrics != nil {
		return g.Metrics
	}
	globalOnce.Do(func() {
		m, err := NewMetrics(otel.GetMeterProvider())
		if err != nil {
			m = nil
		}
		globalMetrics = m
	})
	return globalMetrics
}

// outcome counts a guarded transaction's (or check's) result. A nil error
// counts as committed only when committed is true.
func (m *Metrics) outcome(ctx context.Context, err error, committed bool) {
	if m == nil {
		return
	}
	ctx = context.WithoutCancel(ctx)
	switch {
	case err == nil && committed:
		m.transactions.Add(ctx, 1, outcomeCommitted)
	case err == nil:
	case errors.Is(err, ErrFenced):
		m.transactions.Add(ctx, 1, outcomeStale)
	case errors.Is(err, ErrOutcomeUnknown):
		m.transactions.Add(ctx, 1, outcomeUnknown)
	default:
		m.transactions.Add(ctx, 1, metric.WithAttributes(attribute.String("pgfence.outcome", "error"), errtype.Attr(err)))
	}
}

func (m *Metrics) checked(ctx context.Context, since time.Time) {
	if m != nil {
		m.check.Record(context.WithoutCancel(ctx), time.Since(since).Seconds())
	}
}

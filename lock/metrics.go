package lock

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/buckets"
	"github.com/pgfence/pgfence/internal/errtype"
)

// scope is the instrumentation scope of the lock package's metrics.
const scope = "github.com/pgfence/pgfence/lock"

// metrics are a client's instruments (README's "Metrics"). Lease names are
// not an attribute: they are unbounded (a sharded job has one per shard).
type metrics struct {
	acquisitions metric.Int64Counter
	losses       metric.Int64Counter
	renewTime    metric.Float64Histogram
	slowRenews   metric.Int64Counter
	timeLeft     metric.Float64Histogram
	waitTime     metric.Float64Histogram
	observed     metric.Registration
	fence        *fence.Metrics
}

// Attribute sets, built once.
var (
	resultAcquired = metric.WithAttributeSet(attribute.NewSet(attribute.String("pgfence.outcome", "acquired")))
	resultHeld     = metric.WithAttributeSet(attribute.NewSet(attribute.String("pgfence.outcome", "held")))
)

func newMetrics(c *Client) (*metrics, error) {
	m := c.cfg.MeterProvider.Meter(scope)
	var (
		ms  metrics
		err error
		e   error
	)
	keep := func(x error) { err = cmp.Or(err, x) } // the first error
	ms.acquisitions, e = m.Int64Counter("pgfence.lease.acquisitions", metric.WithUnit("{attempt}"),
		metric.WithDescription("Acquisition attempts, by pgfence.outcome: acquired, held (by another holder), error (with error.type: the SQLSTATE, timeout, canceled, connection or _OTHER)."))
	keep(e)
	ms.losses, e = m.Int64Counter("pgfence.lease.losses", metric.WithUnit("{lease}"),
		metric.WithDescription("Leases lost, by pgfence.cause: expired, taken_over, released_by_operator, renew_failed, database_unreachable."))
	keep(e)
	ms.slowRenews, e = m.Int64Counter("pgfence.lease.renewal.slow", metric.WithUnit("{renewal}"),
		metric.WithDescription("Renewals of the client's session (one statement for all its leases) that took more than half of RenewInterval."))
	keep(e)
	ms.renewTime, e = m.Float64Histogram("pgfence.lease.renewal.duration", metric.WithUnit("s"),
		metric.WithDescription("Round trip of a renewal of the client's session (one statement for all its leases)."),
		metric.WithExplicitBucketBoundaries(buckets.Latency...))
	keep(e)
	ms.timeLeft, e = m.Float64Histogram("pgfence.lease.time_left", metric.WithUnit("s"),
		metric.WithDescription("What was left of a lease's trust window when its renewal succeeded."),
		metric.WithExplicitBucketBoundaries(buckets.TrustLeft...))
	keep(e)
	ms.waitTime, e = m.Float64Histogram("pgfence.lease.wait.duration", metric.WithUnit("s"),
		metric.WithDescription("Time a blocking Acquire waited until it acquired."),
		metric.WithExplicitBucketBoundaries(buckets.Wait...))
	keep(e)
	held, e := m.Int64ObservableUpDownCounter("pgfence.lease.held", metric.WithUnit("{lease}"),
		metric.WithDescription("Leases the client holds."))
	keep(e)
	skew, e := m.Float64ObservableGauge("pgfence.lease.clock_skew", metric.WithUnit("s"),
		metric.WithDescription("The database's clock minus this machine's, estimated at the last renewal."))
	keep(e)
	// Counted from the client's start, so that they are there (at 0)
	// before the first failure: an alert on their increase then works.
	renewals, e := m.Int64ObservableCounter("pgfence.lease.renewals", metric.WithUnit("{statement}"),
		metric.WithDescription("Renewals of the client's session that succeeded (Stats.Renewals: one statement for all its leases)."))
	keep(e)
	renewalFailures, e := m.Int64ObservableCounter("pgfence.lease.renewal.failures", metric.WithUnit("{statement}"),
		metric.WithDescription("Renewals that failed: the database did not answer in time, refused, or the connection broke (Stats.RenewalFailures)."))
	keep(e)
	if err != nil {
		return nil, fmt.Errorf("lock: metrics: %w", err)
	}
	ms.observed, err = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		st := c.Stats()
		o.ObserveInt64(held, int64(st.Held))
		o.ObserveInt64(renewals, int64(st.Renewals))
		o.ObserveInt64(renewalFailures, int64(st.RenewalFailures))
		if st.Renewals > 0 {
			o.ObserveFloat64(skew, st.ClockSkew.Seconds())
		}
		return nil
	}, held, skew, renewals, renewalFailures)
	if err != nil {
		return nil, fmt.Errorf("lock: metrics: %w", err)
	}
	if ms.fence, err = fence.NewMetrics(c.cfg.MeterProvider); err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	// Every loss cause's series exists from the start, at 0: a rate or an
	// increase over a series that appears at 1 misses that first loss.
	for _, cause := range []LossCause{CauseExpired, CauseTakenOver, CauseReleasedByOperator, CauseRenewFailed, CauseUnreachable} {
		ms.losses.Add(context.Background(), 0, metric.WithAttributes(attribute.String("pgfence.cause", string(cause))))
	}
	return &ms, nil
}

// attempted counts one acquisition attempt's result.
func (m *metrics) attempted(ctx context.Context, err error) {
	switch {
	case err == nil:
		m.acquisitions.Add(ctx, 1, resultAcquired)
	case errors.Is(err, ErrHeld):
		m.acquisitions.Add(ctx, 1, resultHeld)
	default:
		m.acquisitions.Add(ctx, 1, metric.WithAttributes(attribute.String("pgfence.outcome", "error"), errtype.Attr(err)))
	}
}

func (m *metrics) lost(cause LossCause) {
	m.losses.Add(context.Background(), 1, metric.WithAttributes(attribute.String("pgfence.cause", string(cause))))
}

func (m *metrics) slowRenewal() { m.slowRenews.Add(context.Background(), 1) }

package lock_test

import (
	"context"
	"math"
	"slices"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// quantile estimates the q-quantile of a histogram the way Prometheus'
// histogram_quantile does: find the bucket the rank falls in and
// interpolate linearly within it (the first bucket's lower bound is 0).
func quantile(q float64, bounds []float64, counts []uint64) float64 {
	var total uint64
	for _, c := range counts {
		total += c
	}
	rank := q * float64(total)
	var seen float64
	for i, c := range counts {
		if seen+float64(c) >= rank && c > 0 {
			lo := 0.0
			if i > 0 {
				lo = bounds[i-1]
			}
			if i == len(bounds) { // +Inf: Prometheus answers the last bound
				return bounds[len(bounds)-1]
			}
			return lo + (bounds[i]-lo)*(rank-seen)/float64(c)
		}
		seen += float64(c)
	}
	return math.NaN()
}

// The renewal-latency histogram answers: its p99, read off the buckets as
// Prometheus reads it, is within 2x of the p99 of the renewal round trips
// the client measured (Stats.LastRenewLatency after each renewal). With
// the SDK's default buckets (0, 5, 10 ... for milliseconds) every renewal
// fell in the first bucket and the estimate was about 4.95 s.
func TestRenewLatencyHistogramAnswers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	c := newClient(t, db, lock.Config{TTL: time.Second, RenewInterval: 20 * time.Millisecond, MeterProvider: mp})
	if _, err := c.TryAcquire(ctx, "histogram"); err != nil {
		t.Fatal(err)
	}
	var samples []float64
	last := c.Stats().Renewals
	for len(samples) < 200 {
		st := c.Stats()
		if st.Renewals != last {
			last = st.Renewals
			samples = append(samples, st.LastRenewLatency.Seconds())
		}
		time.Sleep(time.Millisecond)
	}
	slices.Sort(samples)
	measured := samples[len(samples)*99/100]

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	var h *metricdata.HistogramDataPoint[float64]
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "pgfence.lease.renew.duration" {
				if d, ok := m.Data.(metricdata.Histogram[float64]); ok && len(d.DataPoints) == 1 {
					h = &d.DataPoints[0]
				}
			}
		}
	}
	if h == nil {
		t.Fatal("no pgfence.lease.renew.duration histogram")
	}
	est := quantile(0.99, h.Bounds, h.BucketCounts)
	t.Logf("%d renewals: measured p99 %.3f ms, the histogram's %.3f ms (%d buckets)", h.Count, measured*1000, est*1000, len(h.Bounds))
	if est > 2*measured || est < measured/2 {
		t.Errorf("the histogram's p99 is %.4f s, the measured one %.4f s: more than 2x apart", est, measured)
	}
}

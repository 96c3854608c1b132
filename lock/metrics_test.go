package lock_test

import (
	"context"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/metric"
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
// themselves (every one the client measured, the Stats.LastRenewLatency of
// each renewal, taken as it is recorded). With the SDK's default buckets
// (0, 5, 10 ... for milliseconds) every renewal fell in the first bucket
// and the estimate was about 4.95 s.
func TestRenewLatencyHistogramAnswers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	reader := sdkmetric.NewManualReader()
	sdk := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = sdk.Shutdown(context.Background()) })
	mp := &recordingProvider{MeterProvider: sdk, name: "pgfence.lease.renewal.duration"}
	// A TTL far above the RenewInterval: one renewal late on a loaded
	// machine must not end the session, which would end the renewals.
	c := newClient(t, db, lock.Config{TTL: 10 * time.Second, RenewInterval: 20 * time.Millisecond, MeterProvider: mp})
	l, err := c.TryAcquire(ctx, "histogram")
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, 30*time.Second, "200 renewals", func() bool { return len(mp.values()) >= 200 })
	if err := l.Release(ctx); err != nil { // no more renewals: the two sets settle
		t.Fatal(err)
	}
	// The histogram and the values it was given, once they hold the same
	// renewals (a pass in flight at the release may still record).
	var (
		h      *metricdata.HistogramDataPoint[float64]
		values []float64
	)
	pgtest.Eventually(t, 10*time.Second, "the histogram to hold every renewal recorded", func() bool {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(ctx, &rm); err != nil {
			t.Fatal(err)
		}
		h = nil
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				if d, ok := m.Data.(metricdata.Histogram[float64]); ok && m.Name == "pgfence.lease.renewal.duration" && len(d.DataPoints) == 1 {
					h = &d.DataPoints[0]
				}
			}
		}
		values = mp.values()
		return h != nil && h.Count == uint64(len(values))
	})
	slices.Sort(values)
	// The p99 lies between the order statistics around rank 0.99 n (with
	// a tight body and a few slow renewals, the two can be far apart): the
	// histogram's must be within 2x of that range.
	rank := len(values) * 99 / 100
	lo, hi := values[rank-1], values[rank]
	est := quantile(0.99, h.Bounds, h.BucketCounts)
	t.Logf("%d renewals: measured p99 between %.3f and %.3f ms, the histogram's %.3f ms (%d buckets)", h.Count, lo*1000, hi*1000, est*1000, len(h.Bounds))
	if est > 2*hi || est < lo/2 {
		t.Errorf("the histogram's p99 is %.4f s, the measured one between %.4f and %.4f s: more than 2x apart", est, lo, hi)
	}
}

// recordingProvider is a MeterProvider that keeps every value recorded in
// the histogram name, besides passing it on.
type recordingProvider struct {
	metric.MeterProvider
	name string
	mu   sync.Mutex
	vals []float64
}

func (p *recordingProvider) Meter(name string, opts ...metric.MeterOption) metric.Meter {
	return recordingMeter{Meter: p.MeterProvider.Meter(name, opts...), p: p}
}

func (p *recordingProvider) values() []float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.vals)
}

type recordingMeter struct {
	metric.Meter
	p *recordingProvider
}

func (m recordingMeter) Float64Histogram(name string, opts ...metric.Float64HistogramOption) (metric.Float64Histogram, error) {
	h, err := m.Meter.Float64Histogram(name, opts...)
	if err != nil || name != m.p.name {
		return h, err
	}
	return recordingHistogram{Float64Histogram: h, p: m.p}, nil
}

type recordingHistogram struct {
	metric.Float64Histogram
	p *recordingProvider
}

func (h recordingHistogram) Record(ctx context.Context, v float64, opts ...metric.RecordOption) {
	h.p.mu.Lock()
	h.p.vals = append(h.p.vals, v)
	h.p.mu.Unlock()
	h.Float64Histogram.Record(ctx, v, opts...)
}

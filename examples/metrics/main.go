// Command metrics shows pgfence's OpenTelemetry metrics. It installs the
// OpenTelemetry SDK with the stdout exporter, takes a lease through
// acquisition, renewals, a guarded write and release, runs a job through the
// runner, and prints every instrument, one line each.
//
//	DATABASE_URL='postgres://postgres@127.0.0.1:5432/test?sslmode=disable' go run ./examples/metrics
//
// Without DATABASE_URL it starts a throwaway private PostgreSQL server and
// removes it at exit.
// In a service, use a Prometheus or OTLP exporter instead of stdout; pgfence
// only needs the MeterProvider (lock.Config.MeterProvider, or the global
// one set with otel.SetMeterProvider).
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/stdout/stdoutmetric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/pgfence/pgfence/examples/internal/exampledb"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := open(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "metrics:", err)
		os.Exit(1)
	}
}

func open(ctx context.Context) error {
	db, err := exampledb.Open(ctx, os.Stderr)
	if err != nil {
		return err
	}
	defer db.Close()
	return run(ctx, db.Pool, "pgfence", os.Stdout)
}

func run(ctx context.Context, pool *pgxpool.Pool, schema string, out io.Writer) error {
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		return err
	}
	// The SDK, exporting to out when it shuts down (a service would use a
	// periodic reader with a Prometheus or OTLP exporter).
	exp, err := stdoutmetric.New(stdoutmetric.WithEncoder(lines{out}))
	if err != nil {
		return err
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp, sdkmetric.WithInterval(time.Hour))))

	c, err := lock.New(pool, lock.Config{Schema: schema, TTL: 900 * time.Millisecond, MeterProvider: mp})
	if err != nil {
		return err
	}
	defer c.Close(ctx) // after the last export: Close ends its gauges
	l, err := c.Acquire(ctx, "metrics-example")
	if err != nil {
		return err
	}
	time.Sleep(700 * time.Millisecond) // a couple of renewals
	if err := l.RunTx(ctx, func(tx pgx.Tx) error { _, err := tx.Exec(ctx, "SELECT 1"); return err }); err != nil {
		return err
	}
	if err := l.Release(ctx); err != nil {
		return err
	}

	r, err := runner.New(c, runner.Config{}) // the same client: one renewer, one listener
	if err != nil {
		return err
	}
	done := make(chan struct{})
	err = r.Register(runner.Job{Name: "metrics-example", Schedule: "@every 100ms", Run: func(ctx context.Context, run *runner.Run) error {
		select {
		case <-done:
		default:
			close(done)
		}
		return nil
	}})
	if err != nil {
		return err
	}
	rctx, stop := context.WithCancel(ctx)
	go func() {
		select {
		case <-done:
		case <-ctx.Done():
		}
		time.Sleep(100 * time.Millisecond)
		stop()
	}()
	if err := r.Run(rctx); err != nil {
		return err
	}
	return mp.Shutdown(ctx) // exports once more: every instrument
}

// lines is a stdoutmetric encoder that prints one line per data point:
// name{attributes} value (a histogram: count and sum).
type lines struct{ w io.Writer }

func (l lines) Encode(v any) error {
	rm, ok := v.(*metricdata.ResourceMetrics)
	if !ok {
		return fmt.Errorf("unexpected %T", v)
	}
	var out []string
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					out = append(out, fmt.Sprintf("%s%s %d %s", m.Name, attrs(p.Attributes), p.Value, m.Unit))
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					out = append(out, fmt.Sprintf("%s%s %d %s", m.Name, attrs(p.Attributes), p.Value, m.Unit))
				}
			case metricdata.Gauge[float64]:
				for _, p := range d.DataPoints {
					out = append(out, fmt.Sprintf("%s%s %.6f %s", m.Name, attrs(p.Attributes), p.Value, m.Unit))
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					out = append(out, fmt.Sprintf("%s%s count=%d sum=%.6f %s", m.Name, attrs(p.Attributes), p.Count, p.Sum, m.Unit))
				}
			}
		}
	}
	sort.Strings(out)
	_, err := fmt.Fprintln(l.w, strings.Join(out, "\n"))
	return err
}

func attrs(s attribute.Set) string {
	if s.Len() == 0 {
		return ""
	}
	var kv []string
	for _, a := range s.ToSlice() {
		kv = append(kv, string(a.Key)+"="+a.Value.Emit())
	}
	return "{" + strings.Join(kv, ",") + "}"
}

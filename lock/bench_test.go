package lock_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// BenchmarkAcquireRelease measures acquire+release pairs per second against
// the durable floor on the same server in the same run: pairs of plain
// single-row UPDATE commits (acquire and release are two commits each).
// The floor and pgfence alternate in sixteen rounds so drift on a noisy
// machine hits both; "ratio" is pgfence's pairs/s over the floor's with the
// default (asynchronously committed) release, "ratio_durable" the same with
// Config.DurableRelease, measured in a third phase of each round.
//
//	go test -run '^$' -bench AcquireRelease -benchtime 8000x ./lock
func BenchmarkAcquireRelease(b *testing.B) {
	for _, clients := range []int{1, 8} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			db := pgtest.New(b)
			ctx := context.Background()
			pool := pgtest.NewPool(b, "bench", func(c *pgxpool.Config) { c.MaxConns = int32(clients) + 2 })
			tbl := pgx.Identifier{db.Schema, "bench_floor"}.Sanitize()
			if _, err := pool.Exec(ctx, "CREATE TABLE "+tbl+" (id int PRIMARY KEY, v bigint NOT NULL)"); err != nil {
				b.Fatal(err)
			}
			for i := range clients {
				if _, err := pool.Exec(ctx, "INSERT INTO "+tbl+" VALUES ($1, 0)", i); err != nil {
					b.Fatal(err)
				}
			}
			newClient := func(durable bool, mp metric.MeterProvider) *lock.Client {
				c, err := lock.New(pool, lock.Config{Schema: db.Schema, TTL: time.Minute, DurableRelease: durable, Logger: quiet,
					MeterProvider: mp})
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { _ = c.Close(ctx) })
				return c
			}
			// The default clients use the global MeterProvider (no SDK
			// installed: no-op); sdk is the default client with an
			// OpenTelemetry SDK recording every instrument.
			sdkMP := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			b.Cleanup(func() { _ = sdkMP.Shutdown(ctx) })
			async, durable, sdk := newClient(false, nil), newClient(true, nil), newClient(false, sdkMP)
			upd := "UPDATE " + tbl + " SET v = v + 1 WHERE id = $1"
			floor := func(id, n int) {
				for range n {
					for range 2 {
						if _, err := pool.Exec(ctx, upd, id); err != nil {
							b.Error(err)
							return
						}
					}
				}
			}
			pairs := func(c *lock.Client) func(id, n int) {
				return func(id, n int) {
					name := fmt.Sprintf("bench-%d", id)
					for range n {
						l, err := c.TryAcquire(ctx, name)
						if err != nil {
							b.Error(err)
							return
						}
						if err := l.Release(ctx); err != nil {
							b.Error(err)
							return
						}
					}
				}
			}
			// Warm every path (connections, prepared statements, rows).
			parallel(clients, 20, floor)
			parallel(clients, 20, pairs(async))
			parallel(clients, 20, pairs(durable))
			parallel(clients, 20, pairs(sdk))
			// Give both tables statistics, as autovacuum soon would in
			// production: plans then change (a sequential scan of a small
			// table instead of its index), and a fresh table would flatter.
			for _, t := range []string{tbl, pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()} {
				if _, err := pool.Exec(ctx, "ANALYZE "+t); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			const rounds = 16
			per := max(b.N/clients/rounds, 1)
			var tFloor, tLib, tDurable, tSDK time.Duration
			for range rounds {
				tFloor += parallel(clients, per, floor)
				tLib += parallel(clients, per, pairs(async))
				tDurable += parallel(clients, per, pairs(durable))
				tSDK += parallel(clients, per, pairs(sdk))
			}
			b.StopTimer()
			total := float64(rounds * per * clients)
			libRate, floorRate := total/tLib.Seconds(), total/tFloor.Seconds()
			b.ReportMetric(libRate, "pairs/s")
			b.ReportMetric(floorRate, "floor_pairs/s")
			b.ReportMetric(libRate/floorRate, "ratio")
			b.ReportMetric(tFloor.Seconds()/tDurable.Seconds(), "ratio_durable")
			b.ReportMetric(tLib.Seconds()/tSDK.Seconds(), "sdk_vs_noop")
			// How the leases table fared: its size in pages (8 rows; it
			// grows only when an update cannot stay on its row's page).
			var pages int64
			if err := pool.QueryRow(ctx, "SELECT pg_relation_size($1::regclass) / 8192",
				pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()).Scan(&pages); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(pages), "lease_pages")
		})
	}
}

// parallel runs fn(id, n) on `clients` goroutines and returns the wall time.
func parallel(clients, n int, fn func(id, n int)) time.Duration {
	var wg sync.WaitGroup
	start := time.Now()
	for id := range clients {
		wg.Add(1)
		go func() { defer wg.Done(); fn(id, n) }()
	}
	wg.Wait()
	return time.Since(start)
}

// BenchmarkWakeOnRelease measures how long a waiter blocked in Acquire takes
// to get the lease after the holder's Release returns (the waiter's poll
// interval is 30s, so only the NOTIFY path is measured). Metrics: the median
// and the worst latency in ms.
//
//	go test -run '^$' -bench WakeOnRelease -benchtime 200x ./lock
func BenchmarkWakeOnRelease(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	holder, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, TTL: time.Minute, Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	defer holder.Close(ctx)
	waiter, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, TTL: time.Minute, PollInterval: 30 * time.Second, Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	defer waiter.Close(ctx)
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		l, err := holder.TryAcquire(ctx, "wake")
		if err != nil {
			b.Fatal(err)
		}
		got := make(chan time.Time, 1)
		go func() {
			l2, err := waiter.Acquire(ctx, "wake")
			if err != nil {
				b.Error(err)
				close(got)
				return
			}
			at := time.Now()
			_ = l2.Release(ctx)
			got <- at
		}()
		time.Sleep(20 * time.Millisecond) // the waiter is parked on LISTEN
		if err := l.Release(ctx); err != nil {
			b.Fatal(err)
		}
		released := time.Now()
		at, ok := <-got
		if !ok {
			b.FailNow()
		}
		lat = append(lat, at.Sub(released))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50_ms")
	b.ReportMetric(float64(lat[len(lat)-1].Microseconds())/1000, "max_ms")
}

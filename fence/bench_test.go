package fence_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// BenchmarkGuardedTx measures guarded transaction throughput against the same
// transaction unguarded (BEGIN; INSERT; COMMIT), taking turns transaction by
// transaction in the same run. Metrics: runtx_ratio (Guard.RunTx: a separate check round trip)
// and exec_ratio (Guard.Exec: the check pipelined with the INSERT), each as
// guarded tx/s over unguarded tx/s; runtx_bound_ratio is RunTx with the
// server-side idle bound (Guard.IdleTimeout set, as lock's GuardIdleTimeout
// does).
//
//	go test -run '^$' -bench GuardedTx -benchtime 8000x ./fence
func BenchmarkGuardedTx(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	tbl, ins, g := benchTable(b, db, "bench_events")
	var err error
	unguarded := inTx(ctx, db, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, ins, "x")
		return err
	})
	runTx := func() error {
		return g.RunTx(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, ins, "x")
			return err
		})
	}
	pipelined := inTx(ctx, db, func(tx pgx.Tx) error {
		_, err := g.Exec(ctx, tx, ins, "x")
		return err
	})
	// RunTx again, with an OpenTelemetry SDK recording the guard's metrics
	// (the forms above use the global MeterProvider: no SDK, no-op).
	sdkMP := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	defer sdkMP.Shutdown(ctx)
	gs := g
	if gs.Metrics, err = fence.NewMetrics(sdkMP); err != nil {
		b.Fatal(err)
	}
	runTxSDK := func() error {
		return gs.RunTx(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, ins, "x")
			return err
		})
	}
	// RunTx again with the server-side idle bound: what bounding a frozen
	// holder at the server, instead of at the takeover, costs.
	gb := g
	gb.IdleTimeout = time.Minute
	runTxBound := func() error {
		return gb.RunTx(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, ins, "x")
			return err
		})
	}
	per, t := takeTurns(b, func() { analyze(b, db, tbl, table(db, "pgfence_leases")) }, unguarded, runTx, pipelined, runTxSDK, runTxBound)
	b.ReportMetric(per/t[0].Seconds(), "unguarded_tx/s")
	b.ReportMetric(per/t[1].Seconds(), "runtx_tx/s")
	b.ReportMetric(per/t[2].Seconds(), "exec_tx/s")
	b.ReportMetric(t[0].Seconds()/t[1].Seconds(), "runtx_ratio")
	b.ReportMetric(t[0].Seconds()/t[2].Seconds(), "exec_ratio")
	b.ReportMetric(t[0].Seconds()/t[3].Seconds(), "runtx_sdk_ratio")
	b.ReportMetric(t[0].Seconds()/t[4].Seconds(), "runtx_bound_ratio")
}

// BenchmarkServerIdleBounds measures what bounding a frozen holder at the
// server costs each guarded transaction, against the default that costs
// none (the takeover ends a frozen holder's session: lock's
// Config.IdleHolderAfter). Every form is Guard.Exec's one-row transaction
// (BEGIN; the check pipelined with the INSERT; COMMIT), taking turns:
//
//   - none: no bound (the default);
//   - idle_check: idle_in_transaction_session_timeout set in the check's
//     own round trip (Guard.IdleTimeout);
//   - idle_begin: the same setting sent with BEGIN, in BEGIN's round trip
//     (pgx.TxOptions.BeginQuery);
//   - idle_pool: the same setting on the pool's connections (every
//     transaction on that pool is bounded, guarded or not);
//   - txn_begin, txn_pool: PostgreSQL 17's transaction_timeout, sent with
//     BEGIN or set on the pool's connections (on 17 or newer; the metrics
//     are missing before).
//
// TestServerBoundsEndAnIdleGuardedTransaction checks that each form bounds.
// Metrics: each form's tx/s over none's.
//
//	go test -run '^$' -bench ServerIdleBounds -benchtime 8000x ./fence
func BenchmarkServerIdleBounds(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	tbl, ins, g := benchTable(b, db, "bench_bounds")
	var major int
	if err := db.Pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int / 10000").Scan(&major); err != nil {
		b.Fatal(err)
	}
	form := func(pool *pgxpool.Pool, g fence.Guard, begin string) func() error {
		return func() error {
			tx, err := pool.BeginTx(ctx, pgx.TxOptions{BeginQuery: begin})
			if err != nil {
				return err
			}
			defer tx.Rollback(ctx)
			if _, err := g.Exec(ctx, tx, ins, "x"); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	}
	// Each form has a pool of its own, so that each keeps its own warm
	// backend; the pool forms differ only by their setting.
	poolWith := func(params ...string) *pgxpool.Pool {
		return pgtest.NewPool(b, pgtest.UniqueName("bounds"), func(c *pgxpool.Config) {
			c.MaxConns = 1
			for _, p := range params {
				c.ConnConfig.RuntimeParams[p] = "60s"
			}
		})
	}
	bounded := g
	bounded.IdleTimeout = time.Minute
	names := []string{"idle_check", "idle_begin", "idle_pool"}
	forms := []func() error{
		form(poolWith(), g, ""),
		form(poolWith(), bounded, ""),
		form(poolWith(), g, "BEGIN; SET LOCAL idle_in_transaction_session_timeout = '60s'"),
		form(poolWith("idle_in_transaction_session_timeout"), g, ""),
	}
	if major >= 17 {
		names = append(names, "txn_begin", "txn_pool")
		forms = append(forms,
			form(poolWith(), g, "BEGIN; SET LOCAL transaction_timeout = '60s'"),
			form(poolWith("transaction_timeout"), g, ""))
	}
	// Rounds in turn as takeTurns, each round starting one form later, so
	// that every form takes every place in the order equally often.
	run := func(fn func() error) time.Duration {
		start := time.Now()
		if err := fn(); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	for range 50 {
		for _, fn := range forms {
			run(fn)
		}
	}
	analyze(b, db, tbl, table(db, "pgfence_leases"))
	per := max(b.N/len(forms), 1)
	t := make([]time.Duration, len(forms))
	b.ResetTimer()
	for r := range per {
		for i := range forms {
			k := (r + i) % len(forms)
			t[k] += run(forms[k])
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(per)/t[0].Seconds(), "none_tx/s")
	for i, name := range names {
		b.ReportMetric(t[0].Seconds()/t[i+1].Seconds(), name+"_ratio")
	}
}

// BenchmarkResourceAdmit measures a transaction fenced by a resource fence
// against the same transaction unfenced, taking turns transaction by
// transaction. Metrics, fenced tx/s over unfenced tx/s: admit_ratio
// (Resource.Admit, its own round trip, then the INSERT) and exec_ratio
// (Resource.Exec: admission and INSERT pipelined in one round trip).
//
//	go test -run '^$' -bench ResourceAdmit -benchtime 6000x ./fence
func BenchmarkResourceAdmit(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	tbl := table(db, "bench_events")
	mustExec(b, db, "CREATE TABLE "+tbl+" (id bigserial PRIMARY KEY, payload text)")
	ins := "INSERT INTO " + tbl + " (payload) VALUES ($1)"
	res := fence.Resource{Name: "bench-resource", Schema: db.Schema}
	unfenced := inTx(ctx, db, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, ins, "x")
		return err
	})
	admit := inTx(ctx, db, func(tx pgx.Tx) error {
		if err := res.Admit(ctx, tx, 7); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, ins, "x")
		return err
	})
	exec := inTx(ctx, db, func(tx pgx.Tx) error {
		_, err := res.Exec(ctx, tx, 7, ins, "x")
		return err
	})
	per, t := takeTurns(b, func() { analyze(b, db, tbl, table(db, "pgfence_fences")) }, unfenced, admit, exec)
	b.ReportMetric(per/t[0].Seconds(), "unfenced_tx/s")
	b.ReportMetric(t[0].Seconds()/t[1].Seconds(), "admit_ratio")
	b.ReportMetric(t[0].Seconds()/t[2].Seconds(), "exec_ratio")
}

// inTx returns a transaction as a benchmark form: begin, first, commit.
// benchTable creates the table name for a benchmark's one-row inserts and
// returns it, the insert, and the guard of a lease acquired for it.
func benchTable(b testing.TB, db *pgtest.DB, name string) (tbl, ins string, g fence.Guard) {
	tbl = table(db, name)
	mustExec(b, db, "CREATE TABLE "+tbl+" (id bigserial PRIMARY KEY, payload text)")
	c := newClient(b, db, lock.Config{TTL: time.Minute})
	l, err := c.TryAcquire(context.Background(), "bench")
	if err != nil {
		b.Fatal(err)
	}
	return tbl, "INSERT INTO " + tbl + " (payload) VALUES ($1)", l.Guard()
}

func inTx(ctx context.Context, db *pgtest.DB, first func(tx pgx.Tx) error) func() error {
	return func() error {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if err := first(tx); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
}

// takeTurns runs the forms transaction by transaction, in turn, so that a slow
// fsync or a noisy neighbour costs them all alike: 50 warm-up rounds, then
// prepare, then b.N/len(forms) timed rounds. It returns the number of timed
// rounds and each form's total time.
func takeTurns(b *testing.B, prepare func(), forms ...func() error) (float64, []time.Duration) {
	run := func(fn func() error) time.Duration {
		start := time.Now()
		if err := fn(); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	for range 50 {
		for _, fn := range forms {
			run(fn)
		}
	}
	prepare()
	per := max(b.N/len(forms), 1)
	total := make([]time.Duration, len(forms))
	b.ResetTimer()
	for range per {
		for i, fn := range forms {
			total[i] += run(fn)
		}
	}
	b.StopTimer()
	return float64(per), total
}

// analyze gives tables statistics, as autovacuum soon does in production (the
// planner then reads small tables sequentially).
func analyze(b *testing.B, db *pgtest.DB, tables ...string) {
	for _, t := range tables {
		mustExec(b, db, "ANALYZE "+t)
	}
}

// BenchmarkResourceAdmitShared: 8 writers admit the same token on one shared
// resource fence, each in its own transaction with an INSERT, against the
// same 8 writers unfenced. The forms take turns in phases of 200
// transactions per writer; admit_ratio is fenced tx/s over unfenced tx/s.
//
//	go test -run '^$' -bench ResourceAdmitShared -benchtime 6x ./fence
func BenchmarkResourceAdmitShared(b *testing.B) {
	const writers, perPhase = 8, 200
	db := pgtest.New(b)
	wide := *db // one connection per writer
	wide.Pool = pgtest.NewPool(b, "bench-shared", func(c *pgxpool.Config) { c.MaxConns = writers })
	ctx := context.Background()
	tbl := table(db, "bench_shared")
	mustExec(b, db, "CREATE TABLE "+tbl+" (id bigserial PRIMARY KEY, payload text)")
	ins := "INSERT INTO " + tbl + " (payload) VALUES ($1)"
	res := fence.Resource{Name: "bench-shared", Schema: db.Schema}
	unfenced := inTx(ctx, &wide, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, ins, "x")
		return err
	})
	admit := inTx(ctx, &wide, func(tx pgx.Tx) error {
		_, err := res.Exec(ctx, tx, 7, ins, "x")
		return err
	})
	phase := func(fn func() error) time.Duration {
		start := time.Now()
		var wg sync.WaitGroup
		errs := make(chan error, writers)
		for range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range perPhase {
					if err := fn(); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		if err := <-errs; err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	phase(unfenced)
	phase(admit)
	analyze(b, db, tbl, table(db, "pgfence_fences"))
	var tu, ta time.Duration
	b.ResetTimer()
	for range b.N {
		tu += phase(unfenced)
		ta += phase(admit)
	}
	b.StopTimer()
	n := float64(b.N * writers * perPhase)
	b.ReportMetric(n/tu.Seconds(), "unfenced_tx/s")
	b.ReportMetric(n/ta.Seconds(), "admit_tx/s")
	b.ReportMetric(tu.Seconds()/ta.Seconds(), "admit_ratio")
}

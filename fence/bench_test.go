package fence_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// BenchmarkGuardedTx measures guarded transaction throughput against the same
// transaction unguarded (BEGIN; INSERT; COMMIT), taking turns transaction by
// transaction in the same run. Metrics: runtx_ratio (Guard.RunTx: a separate check round trip)
// and exec_ratio (Guard.Exec: the check pipelined with the INSERT), each as
// guarded tx/s over unguarded tx/s.
//
//	go test -run '^$' -bench GuardedTx -benchtime 8000x ./fence
func BenchmarkGuardedTx(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	tbl := table(db, "bench_events")
	mustExec(b, db, "CREATE TABLE "+tbl+" (id bigserial PRIMARY KEY, payload text)")
	c := newClient(b, db, lock.Config{TTL: time.Minute})
	l, err := c.TryAcquire(ctx, "bench")
	if err != nil {
		b.Fatal(err)
	}
	g := l.Guard()
	ins := "INSERT INTO " + tbl + " (payload) VALUES ($1)"
	unguarded := func() error {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, ins, "x"); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	runTx := func() error {
		return g.RunTx(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, ins, "x")
			return err
		})
	}
	pipelined := func() error {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if _, err := g.Exec(ctx, tx, ins, "x"); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	timed := func(fn func() error) time.Duration {
		start := time.Now()
		if err := fn(); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	for range 50 { // warm up
		timed(unguarded)
		timed(runTx)
		timed(pipelined)
	}
	analyze(b, db, tbl, table(db, "pgfence_leases"))
	// The three forms take turns transaction by transaction, so a slow
	// fsync or a noisy neighbour costs all three alike.
	per := max(b.N/3, 1)
	var tu, tr, tp time.Duration
	b.ResetTimer()
	for range per {
		tu += timed(unguarded)
		tr += timed(runTx)
		tp += timed(pipelined)
	}
	b.StopTimer()
	n := float64(per)
	b.ReportMetric(n/tu.Seconds(), "unguarded_tx/s")
	b.ReportMetric(n/tr.Seconds(), "runtx_tx/s")
	b.ReportMetric(n/tp.Seconds(), "exec_tx/s")
	b.ReportMetric(tu.Seconds()/tr.Seconds(), "runtx_ratio")
	b.ReportMetric(tu.Seconds()/tp.Seconds(), "exec_ratio")
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
	const (
		unfenced = iota
		admit    // Admit, then the INSERT
		exec     // Resource.Exec: both in one round trip
	)
	tx := func(form int) time.Duration {
		start := time.Now()
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer tx.Rollback(ctx)
		switch form {
		case admit:
			if err := res.Admit(ctx, tx, 7); err != nil {
				b.Fatal(err)
			}
			_, err = tx.Exec(ctx, ins, "x")
		case exec:
			_, err = res.Exec(ctx, tx, 7, ins, "x")
		default:
			_, err = tx.Exec(ctx, ins, "x")
		}
		if err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	for range 50 { // warm up
		tx(unfenced)
		tx(admit)
		tx(exec)
	}
	analyze(b, db, tbl, table(db, "pgfence_fences"))
	per := max(b.N/3, 1)
	var tu, ta, te time.Duration
	b.ResetTimer()
	for range per {
		tu += tx(unfenced)
		ta += tx(admit)
		te += tx(exec)
	}
	b.StopTimer()
	b.ReportMetric(float64(per)/tu.Seconds(), "unfenced_tx/s")
	b.ReportMetric(tu.Seconds()/ta.Seconds(), "admit_ratio")
	b.ReportMetric(tu.Seconds()/te.Seconds(), "exec_ratio")
}

// analyze gives tables statistics, as autovacuum soon does in production (the
// planner then reads small tables sequentially).
func analyze(b *testing.B, db *pgtest.DB, tables ...string) {
	for _, t := range tables {
		mustExec(b, db, "ANALYZE "+t)
	}
}

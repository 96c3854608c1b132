package runner

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// roundTrips counts statements and batches sent: one round trip each.
type roundTrips struct{ n atomic.Int64 }

func (c *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// BenchmarkRunOverhead measures what the runner adds to one run of a job
// whose body is one INSERT: round trips and time per run, against calling the
// same body bare, alternating in rounds in the same run.
//
//	go test -run '^$' -bench RunOverhead -benchtime 4000x ./runner
func BenchmarkRunOverhead(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	rt := &roundTrips{}
	pool := pgtest.NewPool(b, "bench-runner", func(c *pgxpool.Config) { c.ConnConfig.Tracer = rt })
	if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{db.Schema, "effects"}.Sanitize()+" (v int)"); err != nil {
		b.Fatal(err)
	}
	ins := "INSERT INTO " + pgx.Identifier{db.Schema, "effects"}.Sanitize() + " VALUES (1)"
	body := func(ctx context.Context, _ *Run) error { _, err := pool.Exec(ctx, ins); return err }
	lc, err := lock.New(pool, lock.Config{Schema: db.Schema, TTL: time.Minute, Logger: quietLogger()})
	if err != nil {
		b.Fatal(err)
	}
	defer lc.Close(ctx)
	r, err := New(lc, Config{})
	if err != nil {
		b.Fatal(err)
	}
	j := Job{Name: "bench", Schedule: "@every 1h", Run: body}
	sched, err := j.validate()
	if err != nil {
		b.Fatal(err)
	}
	w := &worker{r: r, j: &job{Job: j, sched: sched}}
	l, err := r.lc.TryAcquire(ctx, w.leaseName())
	if err != nil {
		b.Fatal(err)
	}
	t, err := w.newTerm(l) // as lead does at the start of a term
	if err != nil {
		b.Fatal(err)
	}
	slot := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	bare := func(n int) (time.Duration, int64) {
		before, start := rt.n.Load(), time.Now()
		for range n {
			if err := body(ctx, nil); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start), rt.n.Load() - before
	}
	viaRunner := func(n int) (time.Duration, int64) {
		before, start := rt.n.Load(), time.Now()
		for range n {
			slot = slot.Add(time.Hour)
			w.runSlot(ctx, t, scheduled(slot))
		}
		return time.Since(start), rt.n.Load() - before
	}
	bare(20)
	viaRunner(20)
	const rounds = 8
	per := max(b.N/rounds/2, 1)
	var tb, tr time.Duration
	var nb, nr int64
	b.ResetTimer()
	for range rounds {
		d, n := bare(per)
		tb, nb = tb+d, nb+n
		d, n = viaRunner(per)
		tr, nr = tr+d, nr+n
	}
	b.StopTimer()
	runs := float64(per * rounds)
	b.ReportMetric(float64(nb)/runs, "bare_roundtrips/run")
	b.ReportMetric(float64(nr)/runs, "runner_roundtrips/run")
	b.ReportMetric(float64(tb.Microseconds())/runs, "bare_us/run")
	b.ReportMetric(float64(tr.Microseconds())/runs, "runner_us/run")
	b.ReportMetric(float64((tr-tb).Microseconds())/runs, "overhead_us/run")
	if got := queryCount(b, pool, "SELECT count(*) FROM "+pgx.Identifier{db.Schema, "pgfence_runs"}.Sanitize()+" WHERE status = 'succeeded'"); got < int(runs) {
		b.Fatalf("%d runs recorded, want %d", got, int(runs))
	}
}

func queryCount(b *testing.B, pool *pgxpool.Pool, sql string) int {
	var n int
	if err := pool.QueryRow(context.Background(), sql).Scan(&n); err != nil {
		b.Fatal(err)
	}
	return n
}

package runner_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// BenchmarkOutboxDelivery delivers b.N outbox rows into a sink, exactly
// once, two ways in the same run: a SKIP LOCKED pool of 8 workers (each
// transaction deletes up to 50 rows and inserts them into the sink: the
// baseline, exactly once but with no order per key and no fencing of a
// stale worker's effects beyond its own row locks) and a consumer group of 8
// partitions (each Commit delivers up to 50 rows of its partition in the
// order written and commits the fenced offset). It reports rows per
// second of each and their ratio, relay over baseline. Rows are written
// before the clock starts, 8 per writing transaction (one per partition);
// the relay is timed from when all 8 partitions are led.
//
//	go test -run '^$' -bench OutboxDelivery -benchtime 40000x ./runner
func BenchmarkOutboxDelivery(b *testing.B) {
	const parts, batch = 8, 50
	fill := func(b *testing.B, db *pgtest.DB) {
		b.Helper()
		ctx := context.Background()
		for _, stmt := range []string{
			"CREATE TABLE " + tbl(db, "outbox") + " (id bigserial PRIMARY KEY, part int NOT NULL, body text NOT NULL, txid bigint NOT NULL)",
			"CREATE INDEX ON " + tbl(db, "outbox") + " (part, txid)",
			"CREATE TABLE " + tbl(db, "sink") + " (id bigint PRIMARY KEY, body text NOT NULL)",
			// txid stands for the writing transaction: 8 rows each.
			"INSERT INTO " + tbl(db, "outbox") + " (part, body, txid) SELECT n % 8, repeat('x', 100), n / 8 + 1 FROM generate_series(0, $1 - 1) n",
			"ANALYZE " + tbl(db, "outbox"),
		} {
			args := []any{}
			if stmt[:6] == "INSERT" {
				args = append(args, b.N)
			}
			if _, err := db.Pool.Exec(ctx, stmt, args...); err != nil {
				b.Fatal(err)
			}
		}
	}
	delivered := func(b *testing.B, db *pgtest.DB) int {
		var n int
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+tbl(db, "sink")).Scan(&n); err != nil {
			b.Fatal(err)
		}
		return n
	}

	var baseline, relay float64
	b.Run("skip-locked", func(b *testing.B) {
		db := pgtest.New(b)
		b.StopTimer()
		fill(b, db)
		take := "WITH t AS (DELETE FROM " + tbl(db, "outbox") + " WHERE id IN (SELECT id FROM " + tbl(db, "outbox") +
			" ORDER BY id LIMIT 50 FOR UPDATE SKIP LOCKED) RETURNING id, body) INSERT INTO " + tbl(db, "sink") + " SELECT id, body FROM t"
		b.StartTimer()
		start := time.Now()
		var wg sync.WaitGroup
		for range parts {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					tag, err := db.Pool.Exec(context.Background(), take)
					if err != nil {
						b.Error(err)
						return
					}
					if tag.RowsAffected() == 0 {
						return
					}
				}
			}()
		}
		wg.Wait()
		b.StopTimer()
		if n := delivered(b, db); n != b.N {
			b.Fatalf("delivered %d of %d", n, b.N)
		}
		baseline = float64(b.N) / time.Since(start).Seconds()
		b.ReportMetric(baseline, "rows/s")
	})
	b.Run("group-relay", func(b *testing.B) {
		db := pgtest.New(b)
		b.StopTimer()
		fill(b, db)
		out, sink := tbl(db, "outbox"), tbl(db, "sink")
		deliver := `WITH batch AS (SELECT id, body, txid FROM ` + out + ` WHERE part = $1 AND txid > $2 ORDER BY txid LIMIT 50),
ins AS (INSERT INTO ` + sink + ` SELECT id, body FROM batch)
SELECT count(*), coalesce(max(txid), $2) FROM batch`
		var (
			mu      sync.Mutex
			leading int
			all     = make(chan struct{})
			gate    = make(chan struct{})
			done    = make(chan struct{}, parts)
		)
		lead := func(ctx context.Context, p *runner.Partition) error {
			mu.Lock()
			if leading++; leading == parts {
				close(all)
			}
			mu.Unlock()
			select {
			case <-gate:
			case <-ctx.Done():
				return nil
			}
			for ctx.Err() == nil {
				var n int64
				if err := p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
					var last int64
					err := tx.QueryRow(ctx, deliver, p.Index, p.Offset()).Scan(&n, &last)
					return last, err
				}); err != nil {
					return err
				}
				if n < batch {
					done <- struct{}{}
					<-ctx.Done()
				}
			}
			return nil
		}
		c, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, TTL: time.Minute, Logger: quiet})
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close(context.Background())
		r, err := runner.New(c, runner.Config{})
		if err != nil {
			b.Fatal(err)
		}
		if err := r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: parts, Consume: lead}); err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		go func() { ran <- r.Run(ctx) }()
		<-all
		b.StartTimer()
		start := time.Now()
		close(gate)
		for range parts {
			<-done
		}
		b.StopTimer()
		relay = float64(b.N) / time.Since(start).Seconds()
		cancel()
		if err := <-ran; err != nil {
			b.Fatal(err)
		}
		if n := delivered(b, db); n != b.N {
			b.Fatalf("delivered %d of %d", n, b.N)
		}
		b.ReportMetric(relay, "rows/s")
	})
	if baseline > 0 && relay > 0 {
		b.Logf("relay / SKIP LOCKED: %.2f (%.0f against %.0f rows/s)", relay/baseline, relay, baseline)
	}
}

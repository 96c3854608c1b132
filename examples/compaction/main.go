// Command compaction is pgfence's main production use: several replicas of an
// app each run the same runner job, which compacts an append-only events table
// into a summary table. Exactly one replica compacts each slot; the compaction
// is computed, then written in a transaction fenced by the run's token, so a
// compactor whose lease was taken over while it worked can never count a
// batch twice. While it runs, a chaos loop revokes the leader's lease now and
// then, and a producer keeps appending events.
//
//	go run ./examples/compaction
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/examples/internal/exampledb"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

func main() {
	var (
		schema   = flag.String("schema", "pgfence_compaction_demo", "schema for the demo's tables (dropped and recreated)")
		duration = flag.Duration("for", 4*time.Second, "how long the producer appends events")
		replicas = flag.Int("replicas", 3, "replicas running the compaction job")
	)
	flag.Parse()
	if err := run(*schema, *duration, *replicas); err != nil {
		fmt.Fprintln(os.Stderr, "compaction:", err)
		os.Exit(1)
	}
}

func run(schema string, duration time.Duration, replicas int) error {
	ctx := context.Background()
	db, err := exampledb.Open(ctx, os.Stdout)
	if err != nil {
		return err
	}
	defer db.Close()
	pool, where := db.Pool, db.Where
	fmt.Printf("pgfence compaction demo: %d replicas, database: %s\n", replicas, where)
	q := pgx.Identifier{schema}.Sanitize()
	if err := setup(ctx, pool, schema); err != nil {
		return err
	}
	raw := func() (n, total int64) {
		_ = pool.QueryRow(ctx, "SELECT count(*), coalesce(sum(amount), 0) FROM "+q+".events").Scan(&n, &total)
		return
	}
	summary := func() (n, total int64) {
		_ = pool.QueryRow(ctx, "SELECT coalesce(sum(events), 0), coalesce(sum(total), 0) FROM "+q+".summary").Scan(&n, &total)
		return
	}
	n, total := raw()
	fmt.Printf("before: events %d (amount %d), summary %d events\n", n, total, func() int64 { s, _ := summary(); return s }())

	var succeeded, fenced atomic.Int64
	job := runner.Job{Name: "compact-events", Schedule: "@every 200ms", Run: func(ctx context.Context, run *runner.Run) error {
		return compact(ctx, pool, q, run)
	}}
	runCtx, stopReplicas := context.WithCancel(ctx)
	defer stopReplicas()
	var wg sync.WaitGroup
	for i := 1; i <= replicas; i++ {
		// Each replica has one lock client, which its runner uses.
		client, err := lock.New(pool, lock.Config{Schema: schema, Holder: fmt.Sprintf("replica-%d", i), TTL: 2 * time.Second,
			PollInterval: 100 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			return err
		}
		defer client.Close(context.Background())
		r, err := runner.New(client, runner.Config{OnEvent: func(e runner.Event) {
			switch e.Kind {
			case runner.RunSucceeded:
				succeeded.Add(1)
			case runner.RunFenced:
				fenced.Add(1)
			}
		}})
		if err != nil {
			return err
		}
		if err := r.Register(job); err != nil {
			return err
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = r.Run(runCtx) }()
	}

	// Producer and chaos: append events; revoke the job's lease now and
	// then, as a frozen or partitioned leader would lose it.
	deadline := time.Now().Add(duration)
	for i := 0; time.Now().Before(deadline); i++ {
		if _, err := pool.Exec(ctx, "INSERT INTO "+q+".events (kind, amount) SELECT (ARRAY['click','view','buy'])[1 + g % 3], g % 100 FROM generate_series(1, 500) g"); err != nil {
			return err
		}
		if i%7 == 6 {
			fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, _ = lock.ForceRelease(fctx, pool, schema, "pgfence/job/compact-events")
			cancel()
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Let compaction catch up with the last events, then stop the replicas.
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		var pending int64
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+q+".events WHERE id > (SELECT last_id FROM "+q+".cursor)").Scan(&pending); err != nil {
			return err
		}
		if pending == 0 {
			break
		}
	}
	stopReplicas()
	wg.Wait()

	rn, rt := raw()
	sn, st := summary()
	fmt.Printf("after:  events %d (amount %d), summary %d events (amount %d)\n", rn, rt, sn, st)
	fmt.Printf("compaction runs: %d succeeded, %d fenced (lease revoked mid-run, writes refused)\n", succeeded.Load(), fenced.Load())
	if rn != sn || rt != st {
		fmt.Println("summary totals equal raw totals: NO")
		return errors.New("summary does not match the events")
	}
	fmt.Println("summary totals equal raw totals: yes")
	return nil
}

// compact reads the next batch past the cursor, aggregates it (the slow
// part), then writes the summary and moves the cursor in one fenced
// transaction that also records the run's success.
func compact(ctx context.Context, pool *pgxpool.Pool, q string, run *runner.Run) error {
	var from, to int64
	if err := pool.QueryRow(ctx, "SELECT last_id FROM "+q+".cursor").Scan(&from); err != nil {
		return err
	}
	rows, err := pool.Query(ctx, "SELECT kind, count(*), sum(amount), max(id) FROM (SELECT * FROM "+q+
		".events WHERE id > $1 ORDER BY id LIMIT 2000) b GROUP BY kind", from)
	if err != nil {
		return err
	}
	type agg struct {
		kind          string
		events, total int64
	}
	var batch []agg
	for rows.Next() {
		var a agg
		var maxID int64
		if err := rows.Scan(&a.kind, &a.events, &a.total, &maxID); err != nil {
			return err
		}
		batch = append(batch, a)
		to = max(to, maxID)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	time.Sleep(50 * time.Millisecond) // aggregation takes time; the lease may move meanwhile
	return run.CommitTx(ctx, func(tx pgx.Tx) error {
		for _, a := range batch {
			if _, err := tx.Exec(ctx, "INSERT INTO "+q+".summary AS s VALUES ($1, $2, $3) ON CONFLICT (kind) DO UPDATE SET events = s.events + $2, total = s.total + $3",
				a.kind, a.events, a.total); err != nil {
				return err
			}
		}
		if to > 0 {
			_, err := tx.Exec(ctx, "UPDATE "+q+".cursor SET last_id = $1", to)
			return err
		}
		return nil
	})
}

func setup(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	q := pgx.Identifier{schema}.Sanitize()
	if err := freshSchema(ctx, pool, schema); err != nil {
		return err
	}
	for _, stmt := range []string{
		"CREATE TABLE " + q + ".events (id bigserial PRIMARY KEY, kind text NOT NULL, amount bigint NOT NULL)",
		"CREATE TABLE " + q + ".summary (kind text PRIMARY KEY, events bigint NOT NULL, total bigint NOT NULL)",
		"CREATE TABLE " + q + ".cursor (last_id bigint NOT NULL)",
		"INSERT INTO " + q + ".cursor VALUES (0)",
		"INSERT INTO " + q + ".events (kind, amount) SELECT (ARRAY['click','view','buy'])[1 + g % 3], g % 100 FROM generate_series(1, 20000) g",
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			return err
		}
	}
	return nil
}

// freshSchema drops schema (with everything in it) and applies pgfence's
// migrations there, so the demo starts from a clean slate on every run.
func freshSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return err
	}
	_, err := migrations.Up(ctx, pool, schema)
	return err
}

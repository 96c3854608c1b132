package runner_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/pgfencetest"
	"github.com/pgfence/pgfence/runner"
)

func ExampleRunner() {
	db, cleanup, err := pgfencetest.Open(context.Background()) // a fresh schema on $PGFENCE_TEST_DATABASE_URL (or TEST_DATABASE_URL, DATABASE_URL)
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+db.Schema+".summary (slot timestamptz PRIMARY KEY)"); err != nil {
		log.Fatal(err)
	}

	// One lock client per process: the runner's jobs and the
	// application's own leases share it.
	client, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(context.Background())
	r, err := runner.New(client, runner.Config{})
	if err != nil {
		log.Fatal(err)
	}
	err = r.Register(runner.Job{
		Name:     "compact-events",
		Schedule: "@every 100ms", // or "CRON_TZ=Europe/Paris 0 2 * * *"
		Run: func(ctx context.Context, run *runner.Run) error {
			// The final write and the slot's success commit together,
			// fenced by the run's token.
			err := run.CommitTx(ctx, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "INSERT INTO "+db.Schema+".summary VALUES ($1)", run.Slot)
				return err
			})
			fmt.Println("compacted one slot with token", run.Token)
			stop() // a real program runs until it is told to stop
			return err
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := r.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// compacted one slot with token 1
}

func ExampleRunner_RegisterConsumer() {
	db, cleanup, err := pgfencetest.Open(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	s := db.Schema
	// The orders service's outbox (txid: the writing transaction) and a sink.
	for _, stmt := range []string{
		"CREATE TABLE " + s + ".outbox (id bigserial PRIMARY KEY, part int NOT NULL, body text NOT NULL," +
			" txid bigint NOT NULL DEFAULT pg_current_xact_id()::text::bigint)",
		"CREATE TABLE " + s + ".sink (id bigint PRIMARY KEY, body text NOT NULL)",
		"INSERT INTO " + s + ".outbox (part, body) SELECT n % 2, 'event ' || n FROM generate_series(1, 6) n",
	} {
		if _, err := db.Pool.Exec(ctx, stmt); err != nil {
			log.Fatal(err)
		}
	}
	client, err := lock.New(db.Pool, lock.Config{Schema: s, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(context.Background())
	r, err := runner.New(client, runner.Config{})
	if err != nil {
		log.Fatal(err)
	}
	var delivered atomic.Int64
	err = r.RegisterConsumer(runner.Consumer{
		Group:      "outbox-relay",
		Partitions: 2, // recorded in the schema by the first replica; each partition has one leader
		Consume: func(ctx context.Context, p *runner.Partition) error {
			for ctx.Err() == nil {
				// In one statement (one snapshot): deliver the events of up to
				// 100 whole transactions from the offset on (the next
				// transaction id to read), all ended (below the snapshot's
				// xmin), and commit the offset after the last one.
				var n int64
				err := p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
					var next int64
					err := tx.QueryRow(ctx, `WITH txs AS (SELECT DISTINCT txid FROM `+s+`.outbox WHERE part = $1 AND txid >= $2
  AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint ORDER BY txid LIMIT 100),
batch AS (SELECT id, body, txid FROM `+s+`.outbox JOIN txs USING (txid) WHERE part = $1),
ins AS (INSERT INTO `+s+`.sink SELECT id, body FROM batch)
SELECT count(*), coalesce(max(txid) + 1, $2) FROM batch`, p.Index, p.Offset()).Scan(&n, &next)
					return next, err // effects and offset commit together, fenced
				})
				if err != nil {
					return err // called again after a backoff, while still leading
				}
				delivered.Add(n)
				if delivered.Load() == 6 {
					stop() // a real relay runs until it is told to stop
				}
				if err := p.Wait(ctx); err != nil { // a Wake, or Poll
					return nil
				}
			}
			return nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := r.Run(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Println("delivered", delivered.Load(), "events exactly once")
	// Output:
	// delivered 6 events exactly once
}

// A consumer group's lag: End reports a partition's end offset (here, one
// past the newest transaction in its part of an outbox), and
// operators read each partition's lag (runner.Partitions, `pgfence
// groups`, the status page, pgfence.runner.partition.lag).
func ExampleConsumer() {
	db, cleanup, err := pgfencetest.Open(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	s := db.Schema
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+s+".outbox (part int NOT NULL,"+
		" txid bigint NOT NULL DEFAULT pg_current_xact_id()::text::bigint)"); err != nil {
		log.Fatal(err)
	}
	for range 3 { // three transactions' events, none delivered yet
		if _, err := db.Pool.Exec(ctx, "INSERT INTO "+s+".outbox (part) VALUES (0)"); err != nil {
			log.Fatal(err)
		}
	}
	client, err := lock.New(db.Pool, lock.Config{Schema: s, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(context.Background())
	r, err := runner.New(client, runner.Config{})
	if err != nil {
		log.Fatal(err)
	}
	err = r.RegisterConsumer(runner.Consumer{
		Group:      "relay",
		Partitions: 1,
		Poll:       50 * time.Millisecond,
		// One past the newest transaction with events in the partition
		// (ended or not: the lag is what is there to read, soon if not
		// yet).
		End: func(ctx context.Context, partition int) (int64, error) {
			var end int64
			err := db.Pool.QueryRow(ctx, "SELECT coalesce(max(txid) + 1, 0) FROM "+s+".outbox WHERE part = $1", partition).Scan(&end)
			return end, err
		},
		Consume: func(ctx context.Context, p *runner.Partition) error {
			for ctx.Err() == nil {
				if err := p.Wait(ctx); err != nil { // delivers nothing: its lag stays
					return nil
				}
			}
			return nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		for ctx.Err() == nil {
			parts, err := runner.Partitions(ctx, db.Pool, s, "relay")
			if err == nil && len(parts) == 1 && !parts[0].EndAt.IsZero() {
				p := parts[0] // Lag is End - Offset: here, transaction ids not yet delivered
				fmt.Println("lag = end - offset:", p.Lag == p.End-p.Offset, "; behind:", p.Lag > 0)
				stop()
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	if err := r.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// lag = end - offset: true ; behind: true
}

// Poison items: an item that fails every time would hold its partition up
// for good. After three failures in a row, Consume sets it aside in a
// dead-letter table, in the same Commit that moves the offset past it
// (so it is set aside once, fenced like the rest), and goes on.
func ExamplePartition_Failures() {
	db, cleanup, err := pgfencetest.Open(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
	defer stop()
	s := db.Schema
	for _, stmt := range []string{
		"CREATE TABLE " + s + ".items (id bigint PRIMARY KEY, body text NOT NULL)",
		"INSERT INTO " + s + ".items SELECT n, CASE n WHEN 3 THEN 'poison' ELSE 'ok' END FROM generate_series(1, 5) n",
		"CREATE TABLE " + s + ".done (id bigint PRIMARY KEY)",
		"CREATE TABLE " + s + ".dead_letters (id bigint PRIMARY KEY, body text NOT NULL, error text NOT NULL)",
	} {
		if _, err := db.Pool.Exec(ctx, stmt); err != nil {
			log.Fatal(err)
		}
	}
	process := func(body string) error {
		if body == "poison" {
			return fmt.Errorf("cannot process %q", body)
		}
		return nil
	}
	client, err := lock.New(db.Pool, lock.Config{Schema: s, PollInterval: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(context.Background())
	r, err := runner.New(client, runner.Config{})
	if err != nil {
		log.Fatal(err)
	}
	err = r.RegisterConsumer(runner.Consumer{
		Group:      "worker",
		Partitions: 1,
		Consume: func(ctx context.Context, p *runner.Partition) error {
			for ctx.Err() == nil {
				var (
					id   int64
					body string
				)
				err := db.Pool.QueryRow(ctx, "SELECT id, body FROM "+s+".items WHERE id >= $1 ORDER BY id LIMIT 1", p.Offset()).Scan(&id, &body)
				if errors.Is(err, pgx.ErrNoRows) {
					stop() // a real worker waits for more: p.Wait(ctx)
					return nil
				}
				if err != nil {
					return err
				}
				perr := process(body)
				if perr != nil && p.Failures() < 3 {
					return perr // called again after a backoff; Failures counts
				}
				err = p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
					var err error
					if perr != nil { // the third failure in a row: set it aside
						_, err = tx.Exec(ctx, "INSERT INTO "+s+".dead_letters VALUES ($1, $2, $3)", id, body, perr.Error())
					} else {
						_, err = tx.Exec(ctx, "INSERT INTO "+s+".done VALUES ($1)", id)
					}
					return id + 1, err // the offset of the next item to read
				})
				if err != nil {
					return err
				}
			}
			return nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := r.Run(ctx); err != nil {
		log.Fatal(err)
	}
	var done, dead []int64
	rows, _ := db.Pool.Query(context.Background(), "SELECT id FROM "+s+".done ORDER BY id")
	done, _ = pgx.CollectRows(rows, pgx.RowTo[int64])
	rows, _ = db.Pool.Query(context.Background(), "SELECT id FROM "+s+".dead_letters ORDER BY id")
	dead, _ = pgx.CollectRows(rows, pgx.RowTo[int64])
	fmt.Println("done:", done, "set aside:", dead)
	// Output:
	// done: [1 2 4 5] set aside: [3]
}

package runner_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
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

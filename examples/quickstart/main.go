// Command quickstart is README's quick start: it takes the lease
// "nightly-billing" (waiting while another copy holds it) and, while it holds
// it, records charges that carry the lease's fencing token, each in a guarded
// transaction that the database refuses once another copy has taken over.
// Run two copies: one charges, the other waits and takes over when it ends.
//
//	DATABASE_URL='postgres://postgres@127.0.0.1:5432/test?sslmode=disable' go run ./examples/quickstart
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL")) // "": the libpq variables (PGHOST, ...)
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
	defer pool.Close()
	if err := run(ctx, pool, "pgfence", os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, pool *pgxpool.Pool, schema string, out io.Writer) error {
	// pgfence's tables, in a schema of their own. Every replica may do
	// this at start-up: they queue, and all succeed.
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		return err
	}
	// The protected data: each charge carries the token it was made under.
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS charges (customer text, token bigint)`); err != nil {
		return err
	}
	client, err := lock.New(pool, lock.Config{Schema: schema})
	if err != nil {
		return err
	}
	defer client.Close(context.Background())

	lease, err := client.Acquire(ctx, "nightly-billing") // waits while another copy holds it
	if err != nil {
		return err
	}
	defer lease.Release(ctx) // frees it at once for the next copy, even once ctx is cancelled

	for _, customer := range []string{"alice", "bob", "carol"} {
		// Commits only if no greater token has been issued for the lease:
		// a copy that froze past its lease cannot charge a second time.
		err := lease.RunTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO charges VALUES ($1, $2)`, customer, int64(lease.Token()))
			return err
		})
		if errors.Is(err, fence.ErrFenced) {
			return fmt.Errorf("no longer the leader, stopping: %w", err)
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "charged %s under token %s\n", customer, lease.Token())
	}
	return nil
}

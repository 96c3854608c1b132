// Command quickstart is README's quick start: it takes the lease
// "nightly-billing" (waiting while another copy holds it) and, while it holds
// it, records charges that carry the lease's fencing token, each in a guarded
// transaction that the database refuses once another copy has taken over.
// Each charge is decided and recorded in that transaction, so however many
// copies run, one after the other or at once, each customer is charged once.
//
//	go run ./examples/quickstart
//
// It uses the database DATABASE_URL names or, without it, a throwaway
// private PostgreSQL server that it starts, says so, and removes at exit.
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

	"github.com/pgfence/pgfence/examples/internal/exampledb"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := open(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

// open runs the quick start on DATABASE_URL or, without it, on a
// throwaway private server, removed when it ends.
func open(ctx context.Context) error {
	db, err := exampledb.Open(ctx, os.Stdout)
	if err != nil {
		return err
	}
	defer db.Close()
	cc := db.Pool.Config().ConnConfig
	fmt.Printf("database %q as user %q at %s:%d\n", cc.Database, cc.User, cc.Host, cc.Port)
	return run(ctx, db.Pool, "pgfence", os.Stdout)
}

func run(ctx context.Context, pool *pgxpool.Pool, schema string, out io.Writer) error {
	// pgfence's tables, in a schema of their own. Every replica may do
	// this at start-up: they queue, and all succeed.
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
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

	// The protected data: one charge per customer, with the token it was
	// made under (a real billing run would key it by customer and period).
	// Created under the lease, so that copies starting together do not race.
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS charges (customer text PRIMARY KEY, token bigint NOT NULL)`); err != nil {
		return err
	}
	for _, customer := range []string{"alice", "bob", "carol"} {
		// Commits only if no greater token has been issued for the lease:
		// a copy that froze past its lease cannot charge. The fence refuses
		// stale writes; charging once comes from recording the charge in
		// the same transaction, so a customer an earlier copy charged is
		// not charged again.
		var charged bool
		err := lease.RunTx(ctx, func(tx pgx.Tx) error {
			tag, err := tx.Exec(ctx, `INSERT INTO charges VALUES ($1, $2) ON CONFLICT (customer) DO NOTHING`,
				customer, int64(lease.Token()))
			charged = tag.RowsAffected() == 1
			return err
		})
		if errors.Is(err, fence.ErrFenced) {
			return fmt.Errorf("no longer the leader, stopping: %w", err)
		}
		if err != nil {
			return err
		}
		if charged {
			fmt.Fprintf(out, "charged %s under token %s\n", customer, lease.Token())
		} else {
			fmt.Fprintf(out, "%s is already charged\n", customer)
		}
	}
	return nil
}

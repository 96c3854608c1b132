// Command leader is the smallest leader-election program: run several copies
// and exactly one leads at a time. Its leadership context is cancelled the
// moment the lease is lost; on SIGINT or SIGTERM it releases the lease so
// another copy takes over at once.
//
//	go run ./examples/leader            # in two terminals; Ctrl-C the leader
//	go run ./examples/leader -for 5s    # stop by itself after 5s
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

func main() {
	d := flag.Duration("for", 0, "stop after this long (0: until SIGINT/SIGTERM)")
	schema := flag.String("schema", "pgfence", "schema for pgfence's tables")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *d)
		defer cancel()
	}
	if err := run(ctx, *schema); err != nil {
		fmt.Fprintln(os.Stderr, "leader:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, schema string) error {
	pool, where, err := connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		return err
	}
	client, err := lock.New(pool, lock.Config{Schema: schema, TTL: 5 * time.Second})
	if err != nil {
		return err
	}
	defer client.Close(context.Background())
	fmt.Printf("%s campaigning for \"example-leader\" (database: %s)\n", client.Config().Holder, where)

	e := &lock.Election{
		Client: client,
		Name:   "example-leader",
		Lead: func(ctx context.Context, l *lock.Lease) error {
			fmt.Printf("leading with token %d\n", l.Token())
			tick := time.NewTicker(time.Second)
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done(): // lost, or shutting down
					return nil
				case <-tick.C:
					fmt.Printf("working as leader (token %d)\n", l.Token())
				}
			}
		},
		OnStop: func(l *lock.Lease, err error) {
			if err != nil {
				fmt.Printf("lost leadership: %v\n", err)
				return
			}
			fmt.Println("stepped down; lease released")
		},
	}
	return e.Run(ctx)
}

// connect opens a pool on DATABASE_URL or, when it is not set, on the libpq
// variables (PGHOST, PGPORT, PGUSER, ..., then a local socket or
// localhost:5432), and says which.
func connect(ctx context.Context) (*pgxpool.Pool, string, error) {
	where := "DATABASE_URL"
	if os.Getenv("DATABASE_URL") == "" {
		where = "libpq defaults"
	}
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		return nil, "", fmt.Errorf("no PostgreSQL server found (%s): set DATABASE_URL, e.g.\n"+
			"  DATABASE_URL='postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable'\nor the libpq variables PGHOST, PGPORT, ...: %w", where, err)
	}
	cfg := pool.Config().ConnConfig
	return pool, fmt.Sprintf("%s (%s:%d)", where, cfg.Host, cfg.Port), nil
}

// Package exampledb gives pgfence's examples their database: the one
// DATABASE_URL names or, without it, a throwaway private PostgreSQL server
// (internal/devdb: from the machine's PostgreSQL binaries, or a container
// where Docker is available), which the example says it uses and which is
// removed when the example ends.
package exampledb

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/devdb"
)

// EnvURL names the environment variable that points an example at a server.
const EnvURL = "DATABASE_URL"

// DB is an example's database.
type DB struct {
	// Pool is open on the database.
	Pool *pgxpool.Pool
	// URL connects to it (to hand to the example's other processes).
	URL string
	// Where says which database it is, for the example to print.
	Where string

	srv *devdb.Server
}

// Open connects to DATABASE_URL or, when it is not set, starts a
// throwaway server and tells out so. Close the DB when the example ends.
func Open(ctx context.Context, out io.Writer) (*DB, error) {
	db := &DB{URL: os.Getenv(EnvURL), Where: EnvURL}
	if db.URL == "" {
		srv, err := devdb.Start(ctx, devdb.Options{})
		if err != nil {
			return nil, fmt.Errorf("no %s, and no throwaway server could be started (%w); set it, e.g.\n"+
				"  %s='postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable'", EnvURL, err, EnvURL)
		}
		fmt.Fprintf(out, "no %s: using %s (PostgreSQL %s), removed at exit\n", EnvURL, srv.How, srv.Version)
		db.URL, db.Where, db.srv = srv.URL, "a throwaway server", srv
	}
	pool, err := pgxpool.New(ctx, db.URL)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		db.Close()
		return nil, fmt.Errorf("connect to %s: %w", db.Where, err)
	}
	db.Pool = pool
	cc := pool.Config().ConnConfig
	db.Where = fmt.Sprintf("%s (%s:%d)", db.Where, cc.Host, cc.Port)
	return db, nil
}

// Close closes the pool and removes the throwaway server, if there is one.
func (db *DB) Close() {
	if db.Pool != nil {
		db.Pool.Close()
	}
	if db.srv != nil {
		_ = db.srv.Close()
	}
}

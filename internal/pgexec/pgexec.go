// Package pgexec holds the executor interface every pgfence package
// shares, at the bottom of the import graph: internal packages use it
// without importing a public package above them, and package fence
// re-exports it as fence.DB.
package pgexec

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is the database handle pgfence's functions take: *pgxpool.Pool,
// *pgx.Conn and pgx.Tx (a savepoint for Begin) all satisfy it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// ErrNilDB is fence.ErrNilDB: see there.
var ErrNilDB = errors.New("pgfence: nil database handle")

// NotNil returns nil for a non-nil db, and otherwise ErrNilDB wrapped with
// op, the call's area and name ("lock: Leases").
func NotNil(db DB, op string) error {
	if db == nil {
		return fmt.Errorf("%s: %w", op, ErrNilDB)
	}
	return nil
}

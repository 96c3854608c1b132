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

	"github.com/pgfence/pgfence/internal/wait"
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

// Rollback ends tx on an error path without holding the caller past ctx,
// whatever the network does. While ctx is live it sends ROLLBACK under ctx
// (so under its deadline, and at most wait.CleanupTimeout when it has
// none). Once ctx has ended it sends nothing: pgx then closes the
// connection at once, and the server rolls back a transaction whose
// connection is gone. A savepoint (tx of a transaction) whose ROLLBACK TO
// could not be sent has its connection closed the same way, so that the
// enclosing transaction cannot commit what the savepoint did.
func Rollback(ctx context.Context, tx pgx.Tx) {
	if ctx.Err() == nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, wait.CleanupTimeout)
		defer cancel()
	}
	if err := tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		if conn := tx.Conn(); conn != nil && !conn.IsClosed() {
			closeNow(conn)
		}
	}
}

// closeNow closes conn without waiting on the network: pgx writes its
// goodbye under an already-ended context, so nothing blocks. (A failed
// ROLLBACK of a whole transaction already closes its connection in pgx;
// this is for a savepoint's, where pgx leaves it open.)
func closeNow(conn *pgx.Conn) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = conn.Close(ctx)
}

// Package outcome finds out what became of a transaction whose COMMIT
// failed without the server's own answer. No client-side error says it:
// when the connection is reset right after COMMIT reached the server, pgx v5
// reports the closed connection as an error of a request never sent
// (pgconn.ErrConnClosed, pgconn.SafeToRetry true), and the transaction is
// committed; a FATAL can follow a commit record already written; a reply
// held past the caller's deadline leaves the caller with a timeout. Only the
// server knows, by the transaction's id: a transaction that wants its
// outcome resolved reads its id and the server's timeline in its first
// round trip (IDColumns), and on a failed COMMIT that the server did not
// refuse (Refused), its caller asks (Resolve).
//
// Package fence (RunTx) and the runner's operator writes use it; the
// caller turns the Status into its own errors.
package outcome

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
)

// The errors Commit returns, exported by package fence as
// fence.ErrOutcomeUnknown and fence.ErrNotCommitted (documented there).
var (
	ErrUnknown      = errors.New("fence: commit outcome unknown")
	ErrNotCommitted = errors.New("fence: the transaction did not commit")
)

// Commit commits tx and returns the truth about it: nil if it committed;
// the server's own refusal (Refused) as it is; otherwise what the server,
// asked on db within ctx (Resolve), says of the transaction id: nil,
// ErrNotCommitted, or an *UnknownError, wrapping COMMIT's error.
func Commit(ctx context.Context, tx pgx.Tx, db DB, schema string, id ID) error {
	err := tx.Commit(ctx)
	if err == nil || Refused(err) {
		return err
	}
	return Outcome(ctx, db, schema, id, err)
}

// Outcome asks the server on db (Resolve) what became of transaction id,
// whose COMMIT failed with err, and returns nil if it committed,
// ErrNotCommitted (wrapping err) if it did not, and an *UnknownError
// otherwise.
func Outcome(ctx context.Context, db DB, schema string, id ID, err error) error {
	switch status, why := Resolve(ctx, db, schema, id); status {
	case Committed:
		return nil
	case Aborted:
		return fmt.Errorf("%w: %w (the server reports transaction %s aborted)", ErrNotCommitted, err, id.Xid)
	default:
		return &UnknownError{ID: id, Schema: schema, Why: why, Err: err}
	}
}

// UnknownError is a COMMIT whose outcome could not be learnt: what names
// the transaction, so that it can be asked about later (Resolved), why it
// is not known, and COMMIT's error. It matches ErrUnknown. Package fence
// turns it into its exported *fence.UnknownOutcomeError.
type UnknownError struct {
	ID     ID
	Schema string // where pgfence_timeline lives
	Why    string
	Err    error
}

// Error says that the outcome is unknown, and why.
func (e *UnknownError) Error() string {
	return fmt.Sprintf("%v: %v (%s)", ErrUnknown, e.Err, e.Why)
}

// Is makes errors.Is(err, ErrUnknown) true.
func (e *UnknownError) Is(target error) bool { return target == ErrUnknown }

// Unwrap returns COMMIT's error.
func (e *UnknownError) Unwrap() error { return e.Err }

// DB is what Resolve asks on: a pool, a connection, a transaction.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Status is what became of a transaction.
type Status int

// The outcomes Resolve can find.
const (
	Unknown   Status = iota // the server could not be asked, or no longer knows
	Committed               // the server reports the transaction committed
	Aborted                 // the server reports it aborted: nothing of it took effect
)

// ID names a transaction on one server: its id (xid8, as text; reading it
// assigns one) and what tells that server's history from another's. A
// transaction id means something only on the history that issued it: a
// standby promoted after a failover may have given the same id to another
// transaction, and timeline IDs are not unique (a standby that never saw a
// newer timeline's history file picks the same number). So the server is
// also named by its postmaster's start time: a server whose postmaster has
// not restarted is the one the transaction ran on (a primary cannot move to
// another history while it runs). A crash restart of that same server
// changes it too, and then the outcome is not looked up: Unknown, where
// the server could have answered. That is the price of never answering
// from another history.
type ID struct {
	Xid      string
	Timeline int64
	Started  time.Time // pg_postmaster_start_time()
}

// IDColumns are the select-list columns, comma first, that read a
// transaction's ID (pgfence_timeline lives in schema): append them to the
// transaction's first statement, and scan them into ID.Dest.
func IDColumns(schema string) string {
	return ", pg_current_xact_id()::text, " + ident.Table(schema, "pgfence_timeline") + "(), pg_postmaster_start_time()"
}

// Dest are the scan targets for IDColumns.
func (id *ID) Dest() []any { return []any{&id.Xid, &id.Timeline, &id.Started} }

// IDQuery reads a transaction's ID on its own, for a transaction whose
// first statement cannot carry IDColumns.
func IDQuery(schema string) string { return "SELECT" + IDColumns(schema)[1:] }

// Refused reports a failed COMMIT that the server itself answered with
// "not committed": an ERROR (a serialization failure, a deferred
// constraint) or a ROLLBACK (the transaction had failed). Nothing else
// proves that it did not commit, once COMMIT may have been written: not a
// FATAL or a PANIC (they can follow the commit record), not a broken or
// closed connection, and in particular not pgconn.SafeToRetry, which is
// true for a connection reset right after a COMMIT that went through
// (observed every time with pgx v5.12 on PostgreSQL 15: faultproxy's
// ResetAfterReply, TestCommitUnderWireFaults in fence).
func Refused(err error) bool {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return !Fatal(pg)
	}
	return errors.Is(err, pgx.ErrTxCommitRollback)
}

// Fatal reports a server error that ended the session (FATAL, PANIC).
func Fatal(pg *pgconn.PgError) bool {
	sev := pg.SeverityUnlocalized
	if sev == "" {
		sev = pg.Severity
	}
	return sev == "FATAL" || sev == "PANIC"
}

// poll is how often Resolve asks again while the server still has the
// transaction in progress (its COMMIT not yet done).
const poll = 20 * time.Millisecond

// grace is how long Resolve lets a transaction stay in progress before it
// ends the transaction's backend itself. A COMMIT the server is executing
// is done well within it; a backend still in the transaction after it is
// one whose client is gone without the server knowing (a half-open
// connection: the peer vanished without a FIN, a COMMIT held in the
// network), which would otherwise keep the transaction, and its row locks,
// until an idle timeout or TCP keepalives end it.
const grace = time.Second

// Resolve asks the server what became of the transaction id (read with
// IDColumns) whose COMMIT failed without its answer, on another connection
// than the transaction's: for a pool, one of its own, opened with the
// pool's settings and connect hooks (the pool's connections may be held by
// the very fault that lost the answer, and its slots taken by connections
// pgx is still closing, for up to 15 s), and the pool itself if that one
// cannot ask. A transaction still in progress after grace has its backend
// terminated (only while it is still in that transaction): the server then
// finishes the commit it has begun, or aborts, and either answer is the
// truth.
//
// It asks within ctx, the caller's budget (and at most
// wait.CleanupTimeout): a caller whose deadline has come is not held by a
// network that does not answer, and is told Unknown, with what is needed
// to ask again later. Unknown comes with why: the id was not read, db is a
// closed connection or a transaction, ctx ended before the server answered,
// or it is not the server the transaction ran on any more (ID).
//
// Committed means committed on that server. A COMMIT waiting for a
// synchronous standby is reported committed once it is committed locally
// (pg_xact_status reads the commit log; ending the backend while it waits
// leaves it committed locally): a failover before the standby has it can
// still lose it, as it can lose any commit acknowledged under
// synchronous_commit = local.
func Resolve(ctx context.Context, db DB, schema string, id ID) (Status, string) {
	if id.Xid == "" {
		return Unknown, "the transaction's id was not read"
	}
	if c, isConn := db.(*pgx.Conn); isConn && c.IsClosed() {
		return Unknown, "its connection is closed and there is no other to ask the server on"
	}
	if _, isTx := db.(pgx.Tx); isTx {
		return Unknown, "a savepoint of a transaction whose connection broke: the outcome is that transaction's"
	}
	ctx, cancel := context.WithTimeout(ctx, wait.CleanupTimeout)
	defer cancel()
	gaveUp := func(err error) string {
		return fmt.Sprintf("the server did not answer within the caller's context (at most %v): %v", wait.CleanupTimeout, err)
	}
	if ctx.Err() != nil {
		return Unknown, gaveUp(context.Cause(ctx))
	}
	ask := db
	if pool, ok := db.(*pgxpool.Pool); ok {
		own := ownconn.New(pool)
		defer own.Close()
		ask = own
	}
	statusSQL := "SELECT pg_xact_status($1::xid8), " + ident.Table(schema, "pgfence_timeline") + "(), pg_postmaster_start_time()"
	again := retry.Backoff{Base: poll, Max: time.Second}
	var inProgress time.Time // when the transaction was first seen in progress
	terminated := false
	for n := 0; ; n++ {
		var (
			status *string
			now    ID
		)
		err := ask.QueryRow(ctx, statusSQL, id.Xid).Scan(&status, &now.Timeline, &now.Started)
		switch {
		case err != nil && ctx.Err() != nil:
			return Unknown, gaveUp(err)
		case err != nil && retry.Transient(err) && wait.Sleep(ctx, again.Wait(n)):
			continue // the server restarting, a failover: ask again
		case err != nil && ask != db:
			ask = db // the pool's own settings may be needed (a role set after connect)
			continue
		case err != nil:
			return Unknown, "asking the server failed: " + err.Error()
		case now.Timeline != id.Timeline || !now.Started.Equal(id.Started):
			return Unknown, fmt.Sprintf("the server is not the one the transaction ran on any more "+
				"(timeline %d started %s, then timeline %d started %s)", id.Timeline, id.Started.Format(time.RFC3339Nano),
				now.Timeline, now.Started.Format(time.RFC3339Nano))
		case status == nil:
			return Unknown, "the server no longer knows the transaction"
		case *status == "committed":
			return Committed, ""
		case *status == "aborted":
			return Aborted, ""
		}
		// "in progress": the COMMIT is not done yet, or never arrived.
		if inProgress.IsZero() {
			inProgress = time.Now()
		}
		if !terminated && time.Since(inProgress) >= grace {
			// Failing to end it (no privilege over that backend) leaves
			// the waiting to the server's own bounds.
			_, _ = ask.Exec(ctx, terminateSQL, id.Xid)
			terminated = true
		}
		if !wait.Sleep(ctx, poll) {
			return Unknown, "the server still had the transaction in progress when the caller's context (at most " + wait.CleanupTimeout.String() + ") ended"
		}
	}
}

// terminateSQL ends the backend that is still in the transaction $1 (an
// xid8, as text), if any: pg_stat_activity shows the 32-bit xid, which no
// other running transaction can share. Checking and signalling are not one
// step: behind PgBouncer, a server connection handed to another client in
// between could be hit; pgx's own connection is gone by then, and the
// window is the time between two statements of this query.
const terminateSQL = `SELECT pg_terminate_backend(pid) FROM pg_stat_activity ` +
	`WHERE backend_xid::text::bigint = $1::text::bigint % 4294967296 AND pg_xact_status($1::xid8) = 'in progress'`

package fence

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/outcome"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/retry"
)

var (
	// ErrStaleToken is returned when a token lower than the newest one issued
	// for the lease (or the highest one a resource fence has admitted) is
	// presented. The transaction it guarded did not commit. The error is a
	// *StaleTokenError with the details.
	ErrStaleToken = errors.New("fence: stale token")

	// ErrUnknownLease is returned when the guarded lease name has never been
	// acquired: no token has been issued for it, so no token can be valid.
	ErrUnknownLease = errors.New("fence: unknown lease")

	// ErrTokenNotIssued is returned when the presented token is greater than
	// any token issued for the lease: it was not obtained from pgfence.
	ErrTokenNotIssued = errors.New("fence: token was never issued")

	// ErrInvalidToken is returned for a token < 1 or one that does not parse.
	ErrInvalidToken = errors.New("fence: invalid token")

	// ErrInvalidName is returned for an empty, over-long (more than 255
	// bytes) or non-UTF-8 lease or resource name, or one containing NUL.
	ErrInvalidName = errors.New("fence: invalid name")

	// ErrFenced is the one errors.Is target for "you are no longer the
	// holder: stop acting". It matches:
	//   - a *StaleTokenError (a greater token was issued or admitted);
	//   - lock.ErrLeaseLost (the lease was lost, taken over, freed by an
	//     operator, or not renewed in time) and runner.ErrFenced;
	//   - a serialization failure (SQLSTATE 40001) of the fence check
	//     itself, in a REPEATABLE READ or SERIALIZABLE transaction whose
	//     snapshot predates a takeover or a forced release of the lease
	//     (*SnapshotError). RunTx runs such a transaction again and then
	//     reports the stale token as a *StaleTokenError.
	// The specific errors stay available through errors.Is and errors.As.
	ErrFenced = errors.New("fence: no longer the holder")

	// ErrNilTx is returned when a guard is given a nil transaction.
	ErrNilTx = errors.New("fence: nil transaction")

	// ErrNilContext is returned, wrapped with the name of the call, by every
	// pgfence function that talks to the database when it is given a nil
	// context (use context.Background() or context.TODO()).
	ErrNilContext = ctxcheck.ErrNilContext

	// ErrNilDB is returned, wrapped with the name of the call, by every
	// pgfence function given a nil database handle (a nil DB interface).
	ErrNilDB = pgexec.ErrNilDB

	// ErrTxClosed is returned when a guard is given a transaction that has
	// already committed or rolled back. It is pgx.ErrTxClosed.
	ErrTxClosed = pgx.ErrTxClosed

	// ErrOutcomeUnknown is returned by RunTx when COMMIT failed without an
	// answer and the server could not be asked within RunTx's context: the
	// transaction may or may not have committed. The error is an
	// *UnknownOutcomeError, whose Resolve asks again later; or read the
	// data back before retrying anything with side effects.
	ErrOutcomeUnknown = outcome.ErrUnknown

	// ErrNotCommitted is returned by RunTx, wrapping the cause, when the
	// transaction certainly did not commit although nothing refused it:
	// the connection failed during COMMIT and the server, asked on another
	// connection, reports that the transaction aborted; or the connection
	// was lost before COMMIT was sent. Nothing it did took effect, and it
	// may be run again (Retryable). RunTx has already run it again, up to
	// MaxAttempts times, unless its context ended.
	ErrNotCommitted = outcome.ErrNotCommitted
)

// UnknownOutcomeError is RunTx's answer when it could not learn, within its
// context, whether the transaction committed: COMMIT was sent and its
// answer lost (a partition, a reset, a reply held past the deadline), and
// the server could not be asked in time. It matches ErrOutcomeUnknown, and
// names the transaction so that its outcome can be asked for once the
// server can be reached again (Resolve).
type UnknownOutcomeError struct {
	// Xid is the transaction's id (xid8) on the server it ran on.
	Xid string
	// Timeline and ServerStarted name that server's history (its timeline
	// and its postmaster's start time): a transaction id means nothing on
	// another history, so Resolve answers only while they are the same.
	Timeline      int64
	ServerStarted time.Time
	// Reason says why the outcome is not known.
	Reason string
	// Err is COMMIT's error.
	Err error
	// Schema is the pgfence schema whose functions Resolve uses.
	Schema string
}

// Error says that the outcome is unknown, and why.
func (e *UnknownOutcomeError) Error() string {
	return fmt.Sprintf("%v: %v (%s)", ErrOutcomeUnknown, e.Err, e.Reason)
}

// Is makes errors.Is(err, ErrOutcomeUnknown) true.
func (e *UnknownOutcomeError) Is(target error) bool { return target == ErrOutcomeUnknown }

// Unwrap returns COMMIT's error.
func (e *UnknownOutcomeError) Unwrap() error { return e.Err }

// Resolve asks the server, on db (a pool or a connection of the same
// database), what became of the transaction, within ctx: nil if it
// committed, an error matching ErrNotCommitted if it did not (nothing of it
// took effect), and a new *UnknownOutcomeError if that still cannot be told
// (ctx ended first, the server failed over or restarted since, or it no
// longer knows the transaction). A transaction the server still has in
// progress a second later (its client gone without the server knowing) has
// its backend ended first, so that it gets an outcome.
func (e *UnknownOutcomeError) Resolve(ctx context.Context, db DB) error {
	if err := ctxcheck.NotNil(ctx, "fence: Resolve"); err != nil {
		return err
	}
	if err := pgexec.NotNil(db, "fence: Resolve"); err != nil {
		return err
	}
	id := outcome.ID{Xid: e.Xid, Timeline: e.Timeline, Started: e.ServerStarted}
	return UnknownOutcome(outcome.Outcome(ctx, db, e.Schema, id, e.Err))
}

// UnknownOutcome returns err with the unknown outcome of a COMMIT, if it
// has one, as an *UnknownOutcomeError, and every other error as it is. It
// is for pgfence's own packages (the runner's operator writes), which
// resolve lost COMMIT answers the same way RunTx does.
func UnknownOutcome(err error) error {
	var u *outcome.UnknownError
	if !errors.As(err, &u) {
		return err
	}
	return &UnknownOutcomeError{Xid: u.ID.Xid, Timeline: u.ID.Timeline, ServerStarted: u.ID.Started,
		Reason: u.Why, Err: u.Err, Schema: u.Schema}
}

// StaleTokenError says which token was presented and which one is current.
// It matches ErrStaleToken with errors.Is.
type StaleTokenError struct {
	// Lease is the lease name, for a lease guard.
	Lease string
	// Resource is the resource name, for a resource fence.
	Resource string
	// Presented is the token the writer presented.
	Presented Token
	// Current is the newest token issued for the lease, or the highest one
	// the resource has admitted.
	Current Token
}

// Error says which token was presented and which is current.
func (e *StaleTokenError) Error() string {
	what := "lease " + strconv.Quote(e.Lease)
	if e.Resource != "" {
		what = "resource " + strconv.Quote(e.Resource)
	}
	return fmt.Sprintf("fence: stale token %d for %s (current %d)", e.Presented, what, e.Current)
}

// Is makes errors.Is(err, ErrStaleToken) and errors.Is(err, ErrFenced) true.
func (e *StaleTokenError) Is(target error) bool {
	return target == ErrStaleToken || target == ErrFenced
}

// SnapshotError reports that the fence check failed with a serialization
// failure (40001): the transaction's snapshot is older than a change of the
// lease's token or holder (a takeover, or a forced release), which only an
// acquisition or an operator makes (renewals do not cause it). The
// transaction is aborted. It matches ErrFenced; Err is the server's error.
type SnapshotError struct {
	// Lease is the lease name.
	Lease string
	// Presented is the token the writer presented.
	Presented Token
	// Err is the serialization failure.
	Err error
}

// Error says what happened.
func (e *SnapshotError) Error() string {
	return fmt.Sprintf("fence: lease %q changed hands after this transaction's snapshot was taken (token %d): %v",
		e.Lease, e.Presented, e.Err)
}

// Is makes errors.Is(err, ErrFenced) true.
func (e *SnapshotError) Is(target error) bool { return target == ErrFenced }

// Unwrap returns the serialization failure.
func (e *SnapshotError) Unwrap() error { return e.Err }

// SQLSTATE codes raised by pgfence_check (see migrations).
const (
	codeStale     = "PF001"
	codeUnknown   = "PF002"
	codeNotIssued = "PF003"
)

// translate turns the errors raised by the database fences (pgfence_check,
// pgfence_admit) into this package's typed errors and leaves everything else
// alone.
func translate(err error, lease string, presented Token) error {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) {
		return err
	}
	switch pg.Code {
	case codeStale:
		cur, _ := strconv.ParseInt(pg.Detail, 10, 64)
		return &StaleTokenError{Lease: lease, Presented: presented, Current: Token(cur)}
	case codeUnknown:
		return fmt.Errorf("%w: %q", ErrUnknownLease, lease)
	case codeNotIssued:
		return fmt.Errorf("%w: token %d for lease %q (current %s)", ErrTokenNotIssued, presented, lease, pg.Detail)
	}
	return err
}

// translateCheck is translate for the lease check's own statement, which
// also turns its serialization failure into a *SnapshotError, and says what
// pgfence was doing when anything else failed (a missing schema, a lost
// connection) instead of handing the driver's words to the caller.
func translateCheck(err error, g Guard, tx pgx.Tx) error {
	var pg *pgconn.PgError
	if errors.As(err, &pg) && pg.Code == "40001" {
		return &SnapshotError{Lease: g.Lease, Presented: g.Token, Err: err}
	}
	if t := translate(err, g.Lease, g.Token); t != err {
		return t
	}
	return fmt.Errorf("fence: check the token of lease %q: %w", g.Lease, hint.Wrap(err, g.Schema, hint.Role(tx)))
}

// Retryable reports whether err, from a guarded transaction, proves that
// the transaction did not commit and that the same work may be tried again
// in a new transaction: ErrNotCommitted (the server reports the COMMIT
// aborted, or the connection was lost before COMMIT was sent: RunTx marks
// both), a connect that failed on every host for a passing reason (refused,
// timed out, read only: a failover in progress), or the server's own ERROR
// for a passing reason (read only 25006, a serialization failure 40001, a
// deadlock 40P01, a lock or statement timeout). It is false when the
// outcome is not known (ErrOutcomeUnknown: read the data back first), when
// the writer is no longer the holder (ErrFenced: stop acting), for
// permanent errors (a missing schema, privileges, invalid data), and for a
// broken connection or a FATAL that no pgfence function has judged: after
// COMMIT was written, neither says whether it committed (pgx's own
// pgconn.SafeToRetry is true for a connection reset right after a COMMIT
// that went through).
//
// So Retryable never says yes for a transaction that committed, whatever
// the error came from; and RunTx (Guard's, Resource's, Lease's) answers
// with errors it can judge. Commit by hand, and a COMMIT that fails without
// the server's ERROR leaves the outcome unknown: use RunTx.
func Retryable(err error) bool {
	switch {
	case err == nil, errors.Is(err, ErrOutcomeUnknown), errors.Is(err, ErrFenced):
		return false
	case errors.Is(err, ErrNotCommitted):
		return true
	}
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		return retry.Transient(err) // nothing was sent
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) && !outcome.Fatal(pg) {
		return retry.Transient(err)
	}
	return false
}

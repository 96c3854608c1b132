package fence

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
	ErrInvalidName = errors.New("pgfence: invalid name")

	// ErrNilTx is returned when a guard is given a nil transaction.
	ErrNilTx = errors.New("fence: nil transaction")

	// ErrTxClosed is returned when a guard is given a transaction that has
	// already committed or rolled back. It is pgx.ErrTxClosed.
	ErrTxClosed = pgx.ErrTxClosed

	// ErrOutcomeUnknown is returned by RunTx when the connection failed
	// during COMMIT: the transaction may or may not have committed. Read the
	// data back before retrying anything with side effects.
	ErrOutcomeUnknown = errors.New("fence: commit outcome unknown")
)

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

// Is makes errors.Is(err, ErrStaleToken) true.
func (e *StaleTokenError) Is(target error) bool { return target == ErrStaleToken }

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

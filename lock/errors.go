package lock

import (
	"errors"
	"fmt"
	"github.com/pgfence/pgfence/fence"
	"time"
)

var (
	// ErrNilPool is returned by New when the pool is nil.
	ErrNilPool = errors.New("lock: nil pool")

	// ErrHeld is matched by *HeldError: the lease is held by another,
	// unexpired holder.
	ErrHeld = errors.New("lock: lease is held")

	// ErrLeaseLost is the cause of a lease's context when the lease was
	// taken over, freed by an operator, expired at the database, or could
	// not be renewed within its local trust window. Everything running
	// under the lease must stop; its guarded writes will be refused.
	ErrLeaseLost = errors.New("lock: lease lost")

	// ErrReleased is the cause of a lease's context after Release.
	ErrReleased = errors.New("lock: lease released")

	// ErrClosed is returned by a Client after Close.
	ErrClosed = errors.New("lock: client closed")
)

// HeldError reports that a lease is held by someone else. It matches ErrHeld.
type HeldError struct {
	// Name is the lease name.
	Name string
	// Holder is the current holder's identity ("" when the row changed
	// while the attempt ran and the holder is not known).
	Holder string
	// Token is the current holder's token.
	Token int64
	// ExpiresAt is when the current holder's lease expires, on the
	// database's clock, unless renewed.
	ExpiresAt time.Time
	// ExpiresIn is ExpiresAt minus the database's clock at the attempt.
	ExpiresIn time.Duration
}

// Error says who holds the lease and until when.
func (e *HeldError) Error() string {
	return fmt.Sprintf("lock: lease %q is held by %q (token %d) until %s", e.Name, e.Holder, e.Token, e.ExpiresAt.UTC().Format(time.RFC3339Nano))
}

// Is makes errors.Is(err, ErrHeld) true.
func (e *HeldError) Is(target error) bool { return target == ErrHeld }

// ErrInvalidName is returned for an empty, over-long (more than 255 bytes),
// non-UTF-8 or NUL-containing lease name. It is fence.ErrInvalidName.
var ErrInvalidName = fence.ErrInvalidName

package lock

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/pgfence/pgfence/fence"
)

var (
	// ErrNilPool is returned by New when the pool is nil.
	ErrNilPool = errors.New("lock: nil pool")

	// ErrHeld is matched by *HeldError: the lease is held by another,
	// unexpired holder.
	ErrHeld = errors.New("lock: lease is held")

	// ErrLeaseLost is the cause of a lease's context when the lease was
	// taken over, freed, expired, or not renewed within its trust window:
	// everything under it must stop. It matches fence.ErrFenced.
	ErrLeaseLost error = leaseLost{}

	// ErrReleased is the cause of a lease's context after Release.
	ErrReleased = errors.New("lock: lease released")

	// ErrClosed is returned by a Client after Close.
	ErrClosed = errors.New("lock: client closed")

	// ErrTryAgain is returned by TryAcquire when an attempt could not
	// finish through no holder's doing (the row kept changing, the
	// session's renewal or start was slow, the lease was lost before it
	// could be handed out). Nothing is held; Acquire tries again.
	ErrTryAgain = errors.New("lock: acquisition interrupted; try again")
)

// HeldError reports that a lease is held by someone else. It matches ErrHeld.
type HeldError struct {
	// Name is the lease name.
	Name string
	// Holder is the current holder's identity ("" when the row changed
	// while the attempt ran and the holder is not known).
	Holder string
	// Token is the current holder's token.
	Token fence.Token
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

// leaseLost is ErrLeaseLost's type: it matches fence.ErrFenced too.
type leaseLost struct{}

func (leaseLost) Error() string { return "lock: lease lost" }

func (leaseLost) Is(target error) bool { return target == fence.ErrFenced }

// BlockedError is returned by ForceRelease when its context ends while
// guarded transactions of the current token hold it up (Backends).
type BlockedError struct {
	// Name is the lease name.
	Name string
	// Backends are the sessions the forced release was waiting for.
	Backends []Backend
	// Err is the context's error.
	Err error
}

// Backend describes a PostgreSQL session (from pg_stat_activity).
type Backend struct {
	PID         int
	Application string
	User        string
	State       string
	XactStart   time.Time
	Query       string
}

// Error names the lease and the sessions that hold it.
func (e *BlockedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "lock: force release %q: waited for the lease row's lock until %v", e.Name, e.Err)
	if len(e.Backends) == 0 {
		b.WriteString(" (the blocking sessions had ended by the time they were looked up)")
	}
	sep := "; held by"
	for _, be := range e.Backends {
		fmt.Fprintf(&b, "%s backend pid %d (application %q, user %q, %s, transaction open %v, last query %q)",
			sep, be.PID, be.Application, be.User, be.State, time.Since(be.XactStart).Round(time.Millisecond), be.Query)
		sep = ","
	}
	return b.String()
}

// Unwrap returns the context's error.
func (e *BlockedError) Unwrap() error { return e.Err }

package lock

import (
	"time"

	"github.com/pgfence/pgfence/fence"
)

// EventKind says what happened to a lease.
type EventKind int

// Event kinds.
const (
	// Acquired: the lease was acquired (TryAcquire or Acquire returned it).
	Acquired EventKind = iota
	// RenewedLate: a renewal succeeded with less than RenewInterval of
	// the trust window left: at least one renewal failed or came late.
	RenewedLate
	// Lost: the lease ended without Release; Cause says why.
	Lost
	// Released: Release ended the lease.
	Released
	// IdleHolderEnded: an acquisition of the lease, waiting on its row
	// after it expired, ended the session of a transaction idle there
	// (Backend; Config.IdleHolderAfter).
	IdleHolderEnded
)

// String returns the kind in snake_case, for logs and metric attributes.
func (k EventKind) String() string {
	return [...]string{"acquired", "renewed_late", "lost", "released", "idle_holder_ended"}[k]
}

// LossCause says why a lease was lost.
type LossCause string

// Loss causes.
const (
	// CauseExpired: the trust window ran out without a failed renewal (a
	// paused process), or the database judged the lease expired.
	CauseExpired LossCause = "expired"
	// CauseTakenOver: another holder acquired the lease (a greater token).
	CauseTakenOver LossCause = "taken_over"
	// CauseReleasedByOperator: someone else freed the lease
	// (ForceRelease, `pgfence release`).
	CauseReleasedByOperator LossCause = "released_by_operator"
	// CauseRenewFailed: the database refused the renewal and the reason
	// could not be read back.
	CauseRenewFailed LossCause = "renew_failed"
	// CauseUnreachable: renewals kept failing (the database could not be
	// reached) until the trust window ran out.
	CauseUnreachable LossCause = "database_unreachable"
)

// Event describes something that happened to one of a client's leases
// (Config.OnEvent).
type Event struct {
	// Kind says what happened.
	Kind EventKind
	// Lease is the lease name; Token its token; Holder this client.
	Lease  string
	Token  fence.Token
	Holder string
	// Cause says why a Lost lease was lost.
	Cause LossCause
	// Err is the loss's error (it wraps ErrLeaseLost), for Lost.
	Err error
	// TimeLeft is what was left of the trust window: for RenewedLate,
	// when the renewal succeeded.
	TimeLeft time.Duration
	// Backend is the session ended, for IdleHolderEnded.
	Backend *Backend
}

func (c *Client) emit(e Event) {
	e.Holder = c.cfg.Holder
	if c.cfg.OnEvent != nil {
		c.cfg.OnEvent(e)
	}
}

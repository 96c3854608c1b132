package lock

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/txbound"
)

// Lease is a held lease: the right to act for a name, with the fencing token
// that proves it to resources. Its context is cancelled (and Done closed) the
// moment the lease is lost, released, or can no longer be trusted locally;
// act only while it is live, and put the token on every protected write.
type Lease struct {
	c      *Client
	s      *session // the client's session that holds it
	name   string
	token  fence.Token
	secret []byte

	ctx    context.Context
	cancel context.CancelCauseFunc

	mu    sync.Mutex
	ended bool
	// out: handed out (a lease lost before ends quietly). announced: its
	// Acquired event was emitted; until then its end's waits in pending.
	out, announced bool
	pending        *Event
}

func newLease(c *Client, s *session, name string, token fence.Token, secret []byte) *Lease {
	l := &Lease{c: c, s: s, name: name, token: token, secret: secret}
	l.ctx, l.cancel = context.WithCancelCause(context.WithValue(context.Background(), leaseKey{}, l))
	return l
}

// Name returns the lease name.
func (l *Lease) Name() string { return l.name }

// Token returns the fencing token of this acquisition. Renewals keep it.
func (l *Lease) Token() fence.Token { return l.token }

// Holder returns the holder identity recorded for the lease.
func (l *Lease) Holder() string { return l.c.cfg.Holder }

// ExpiresAt returns the database's expiry of the client's session (and so
// of the lease) at its last successful renewal.
func (l *Lease) ExpiresAt() time.Time {
	l.s.mu.Lock()
	defer l.s.mu.Unlock()
	return l.s.expiresAt
}

// TrustedUntil returns the local deadline (monotonic clock) until which the
// lease may be trusted without another successful renewal.
func (l *Lease) TrustedUntil() time.Time {
	l.s.mu.Lock()
	defer l.s.mu.Unlock()
	return l.s.trustUntil
}

// Context returns a context that is cancelled when the lease ends; its cause
// wraps ErrLeaseLost or is ErrReleased. FromContext finds the lease in
// every context derived from it.
func (l *Lease) Context() context.Context { return l.ctx }

type leaseKey struct{}

// FromContext returns the lease whose Context ctx derives from, if any
// (it may have ended since).
func FromContext(ctx context.Context) (*Lease, bool) {
	if ctx == nil {
		return nil, false
	}
	l, ok := ctx.Value(leaseKey{}).(*Lease)
	return l, ok
}

// Done is closed when the lease ends (lost or released).
func (l *Lease) Done() <-chan struct{} { return l.ctx.Done() }

// Err returns nil while the lease is live, then why it ended (wrapping
// ErrLeaseLost, or ErrReleased), exactly from the trust deadline on.
func (l *Lease) Err() error {
	if l.ctx.Err() == nil {
		l.mu.Lock()
		ended := l.ended
		l.mu.Unlock()
		if !ended && l.s.left(l.c.clock.Now()) <= 0 {
			l.s.trustElapsed()
		}
	}
	return context.Cause(l.ctx)
}

// Guard returns the fence guard for this lease's token.
func (l *Lease) Guard() fence.Guard {
	return fence.Guard{Lease: l.name, Token: l.token, Schema: l.c.cfg.Schema, Metrics: l.c.m.fence,
		IdleTimeout: l.c.cfg.GuardIdleTimeout}
}

// RunTx runs fn in a transaction fenced by this lease (fence.Guard.RunTx)
// on the client's pool, cancelled if the lease ends; an ended lease
// refuses at once.
func (l *Lease) RunTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	if err := ctxcheck.NotNil(ctx, "lock: Lease.RunTx"); err != nil {
		return err
	}
	if err := l.Err(); err != nil {
		return err
	}
	err := l.Guard().RunTx(txbound.With(ctx, l.ctx), l.c.pool, fn)
	if err != nil && l.ctx.Err() != nil {
		return fmt.Errorf("%w (%w)", l.Err(), err)
	}
	return err
}

// Check confirms at the database that the lease is still held with this token
// and has not expired by the database's clock. If it has not, the lease ends
// with ErrLeaseLost and Check returns that error. A failure to reach the
// database is returned as is and does not end the lease.
func (l *Lease) Check(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "lock: Lease.Check"); err != nil {
		return err
	}
	if err := l.Err(); err != nil {
		return err
	}
	var (
		token     int64
		ours      bool
		live      bool
		expiresAt time.Time
	)
	err := l.c.pool.QueryRow(ctx, l.c.q.check, l.name, l.secret, l.s.id).Scan(&token, &ours, &live, &expiresAt)
	if err != nil {
		return fmt.Errorf("lock: check %q: %w", l.name, l.c.explain(err))
	}
	if cause, err := l.judge(token, ours, live, expiresAt); err != nil {
		l.lose(cause, err)
	}
	return l.Err()
}

// judge says whether the lease row as read means the lease is lost, and why.
func (l *Lease) judge(token int64, ours, live bool, expiresAt time.Time) (LossCause, error) {
	switch {
	case fence.Token(token) != l.token:
		return CauseTakenOver, fmt.Errorf("%w: %q was taken over (token %d, ours %d)", ErrLeaseLost, l.name, token, l.token)
	case !ours:
		return CauseReleasedByOperator, fmt.Errorf("%w: %q was freed by someone else", ErrLeaseLost, l.name)
	case !live:
		return CauseExpired, fmt.Errorf("%w: %q expired at the database at %s", ErrLeaseLost, l.name, expiresAt.UTC().Format(time.RFC3339Nano))
	}
	return "", nil
}

// Release frees the lease for the next holder (a blocked Acquire wakes) and
// ends it with ErrReleased; releasing an ended lease does nothing. It never
// touches a lease since taken by someone else. If the database cannot be
// reached the lease still ends, and the row expires by TTL.
//
// A ctx that has already ended does not stop it: `defer lease.Release(ctx)`
// at shutdown still frees the lease, in the background within 5s
// (wait.CleanupTimeout), waiting at most 500ms (wait.PastDeadline).
func (l *Lease) Release(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "lock: Lease.Release"); err != nil {
		return err
	}
	if !l.end() {
		return nil
	}
	sql := l.c.q.release
	if l.c.cfg.DurableRelease {
		sql = l.c.q.releaseDurable
	}
	return l.c.cleanup(ctx, fmt.Sprintf("release %q", l.name), func(ctx context.Context) error {
		_, err := l.c.pool.Exec(ctx, sql, l.name, int64(l.token), l.secret)
		return err
	})
}

// end ends the lease as released, unless it had ended (false).
func (l *Lease) end() bool {
	ev := Event{Kind: Released, Lease: l.name, Token: l.token}
	ended, _, emit := l.finish(ev, ErrReleased)
	if emit {
		l.c.emit(ev)
	}
	return ended
}

// finish ends the lease with cause, unless it had ended, and reports
// whether it did, whether it had been handed out, and whether ev is to be
// emitted now (if it was handed out but not yet announced, announce emits
// ev).
func (l *Lease) finish(ev Event, cause error) (ended, out, emit bool) {
	l.mu.Lock()
	if l.ended {
		l.mu.Unlock()
		return false, false, false
	}
	l.ended, out, emit = true, l.out, l.announced
	if out && !emit {
		l.pending = &ev
	}
	l.mu.Unlock()
	l.cancel(cause)
	l.c.untrack(l)
	return true, out, emit
}

// handOut marks the lease as the caller's, unless it has ended (false).
func (l *Lease) handOut() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.out = !l.ended
	return l.out
}

func (l *Lease) isOut() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.out
}

// announce emits the Acquired event, then the end's if it ended meanwhile.
func (l *Lease) announce() {
	l.c.emit(Event{Kind: Acquired, Lease: l.name, Token: l.token})
	l.mu.Lock()
	l.announced = true
	pending := l.pending
	l.pending = nil
	l.mu.Unlock()
	if pending != nil {
		l.c.emit(*pending)
	}
}

// lose ends the lease with err (which wraps ErrLeaseLost), lost for cause.
func (l *Lease) lose(cause LossCause, err error) {
	ev := Event{Kind: Lost, Lease: l.name, Token: l.token, Cause: cause, Err: err}
	ended, out, emit := l.finish(ev, err)
	switch {
	case !ended:
		return
	case !out:
		l.c.log.Debug("pgfence: lease lost before it was handed out; acquiring again", "lease", l.name, "token", l.token, "err", err)
		return
	}
	l.c.m.lost(cause)
	l.c.log.Warn("pgfence: lease lost", "lease", l.name, "token", l.token,
		"cause", string(cause), "err", err)
	if emit {
		l.c.emit(ev)
	}
}

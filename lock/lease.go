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
	// out: handed out to the caller. A lease lost before (while its
	// acquisition came back) ends quietly, and the acquisition tries
	// again: its holder never had it. announced: its Acquired event has
	// been emitted; until then its end's event waits in pending, so that
	// no observer hears of its end first.
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

// ExpiresAt returns the expiry the database recorded for the client's
// session at its last successful renewal (or start), on the database's
// clock: the lease lives as long as the session.
func (l *Lease) ExpiresAt() time.Time {
	l.s.mu.Lock()
	defer l.s.mu.Unlock()
	return l.s.expiresAt
}

// TrustedUntil returns the local deadline (monotonic clock) until which the
// lease may be trusted without another successful renewal of the client's
// session.
func (l *Lease) TrustedUntil() time.Time {
	l.s.mu.Lock()
	defer l.s.mu.Unlock()
	return l.s.trustUntil
}

// Context returns a context that is cancelled when the lease ends; its cause
// (context.Cause) wraps ErrLeaseLost or is ErrReleased. It carries the lease:
// FromContext finds it in every context derived from it (an Election's Lead
// context, a runner job's).
func (l *Lease) Context() context.Context { return l.ctx }

type leaseKey struct{}

// FromContext returns the lease whose Context ctx derives from, if any, so
// that code can check that it runs under a lease (and which one); the lease
// may have ended since (see Lease.Err).
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
// ErrLeaseLost, or ErrReleased). It is exact at the trust deadline: once the
// deadline has passed it reports the loss even if the timer that cancels the
// context has not run yet.
func (l *Lease) Err() error {
	if l.ctx.Err() == nil {
		l.mu.Lock()
		ended := l.ended
		l.mu.Unlock()
		if ended || l.s.left(l.c.clock.Now()) > 0 {
			return context.Cause(l.ctx)
		}
		l.s.trustElapsed()
	}
	return context.Cause(l.ctx)
}

// Guard returns the fence guard for this lease's token.
func (l *Lease) Guard() fence.Guard {
	return fence.Guard{Lease: l.name, Token: l.token, Schema: l.c.cfg.Schema, Metrics: l.c.m.fence,
		IdleTimeout: l.c.cfg.GuardIdleTimeout}
}

// RunTx runs fn in a transaction fenced by this lease (see fence.Guard.RunTx)
// on the client's pool. It refuses at once with the lease's error when the
// lease has already ended, and the transaction is cancelled if the lease ends
// while it runs.
func (l *Lease) RunTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	if err := ctxcheck.NotNil(ctx, "lock: Lease.RunTx"); err != nil {
		return err
	}
	if err := l.Err(); err != nil {
		return err
	}
	// The lease's end cancels the transaction's statements (and COMMIT is
	// not sent after it); a lost COMMIT answer is still asked about within
	// ctx.
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

// judge says whether the lease row as read (its token, whether it holds
// this lease's secret, whether it is unexpired) means the lease is lost,
// and why.
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

// Release frees the lease at once for the next holder (a blocked Acquire
// wakes) and ends it with ErrReleased. It is idempotent: releasing an ended
// lease does nothing and returns nil. It never touches a lease that has since
// been taken by someone else. If the database cannot be reached the lease
// still ends locally and the error is returned; the row then expires by TTL.
//
// It returns by ctx's deadline whatever the network does. A ctx that has
// already ended does not stop it: `defer lease.Release(ctx)` at shutdown,
// when ctx is cancelled, still frees the lease, in the client's background
// within 5s (wait.CleanupTimeout); Release waits for that at most 500ms
// (wait.PastDeadline), and if it is not done by then says so in an error
// that wraps ctx's.
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

// end ends the lease as released, before the row is freed: its context is
// cancelled with ErrReleased and it is renewed no more. It reports false if
// the lease had already ended.
func (l *Lease) end() bool {
	l.mu.Lock()
	if l.ended {
		l.mu.Unlock()
		return false
	}
	l.ended = true
	emit := l.endEvent(Event{Kind: Released, Lease: l.name, Token: l.token})
	l.mu.Unlock()
	l.cancel(ErrReleased)
	l.c.untrack(l)
	if emit {
		l.c.emit(Event{Kind: Released, Lease: l.name, Token: l.token})
	}
	return true
}

// endEvent says whether the event of the lease's end is to be emitted now:
// only for a lease handed out, and only once its Acquired event has been
// (before that, announce emits it). The caller holds l.mu.
func (l *Lease) endEvent(e Event) bool {
	if l.out && !l.announced {
		l.pending = &e
	}
	return l.announced
}

// handOut marks the lease as the caller's, unless it has already ended
// (reported false).
func (l *Lease) handOut() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.out = !l.ended
	return l.out
}

// isOut reports whether the lease was handed out.
func (l *Lease) isOut() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.out
}

// announce emits the Acquired event of a lease handed out, then the event
// of its end if it ended meanwhile.
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
	l.mu.Lock()
	if l.ended {
		l.mu.Unlock()
		return
	}
	l.ended = true
	out := l.out
	ev := Event{Kind: Lost, Lease: l.name, Token: l.token, Cause: cause, Err: err}
	emit := l.endEvent(ev)
	l.mu.Unlock()
	l.cancel(err)
	l.c.untrack(l)
	if !out {
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

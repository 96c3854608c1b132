package lock

import (
	"context"
	cryptorand "crypto/rand"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/notify"
	"github.com/pgfence/pgfence/internal/retry"
)

// TryAcquire acquires the lease name if it is free or released (one round
// trip), or if its holder's session has expired (a takeover: two more);
// otherwise it returns a *HeldError. The new lease's token is greater than
// every token issued before. The client's first acquisition checks that
// the schema is migrated (*migrations.NotMigratedError). If ctx ends while
// the acquisition is in flight, a lease the database still grants is
// freed in the background.
func (c *Client) TryAcquire(ctx context.Context, name string) (*Lease, error) {
	if err := ctxcheck.NotNil(ctx, "lock: TryAcquire"); err != nil {
		return nil, err
	}
	if err := fence.ValidateName(name); err != nil {
		return nil, err
	}
	secret := newSecret()
	l, err := c.tryAcquire(ctx, name, secret)
	if pid, ok := inDoubt(err); ok {
		c.abandon(name, secret, pid)
	}
	return l, err
}

// attemptBound bounds one attempt of a blocking Acquire, past the longest
// it waits for a frozen holder (Config.IdleHolderAfter): one sent into a
// partition would otherwise wait, after the heal, for TCP's next
// retransmission.
func (c *Client) attemptBound() time.Duration { return 2*c.cfg.TTL + c.cfg.PollInterval }

func newSecret() []byte {
	secret := make([]byte, 16)
	_, _ = cryptorand.Read(secret)
	return secret
}

// backoffOrWake waits d, or until w (if not nil) wakes; it returns false if
// ctx ends first.
func backoffOrWake(ctx context.Context, d time.Duration, w *notify.Sub) bool {
	var woken <-chan struct{}
	if w != nil {
		woken = w.C
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	case <-woken:
	}
	return true
}

// errRowChanging: three attempts in a row found the row changed under
// them, or lost what they won before handing it out.
var errRowChanging = fmt.Errorf("%w: the row kept changing under three attempts", ErrTryAgain)

// tryAcquire is TryAcquire with a given secret: Acquire keeps one across
// its attempts, so that one whose reply was lost is adopted by the next. A
// lease is handed out only with a RenewInterval of trust left: the session
// is renewed first, and again after an acquisition that came back late.
func (c *Client) tryAcquire(ctx context.Context, name string, secret []byte) (l *Lease, err error) {
	defer func() {
		c.m.attempted(ctx, err)
		if l != nil {
			l.announce()
		}
	}()
	if _, closed := c.state(); closed {
		return nil, ErrClosed
	}
	if err := c.verify(ctx); err != nil {
		return nil, err
	}
	var held *HeldError
	for range 3 {
		s, err := c.liveSession(ctx)
		if err != nil {
			if errors.Is(err, ErrClosed) {
				return nil, err
			}
			return nil, fmt.Errorf("lock: acquire %q: %w", name, c.explain(err))
		}
		seen := s.generation()
		token, r, err := c.attempt(ctx, name, secret, s)
		if err != nil {
			return nil, fmt.Errorf("lock: acquire %q: %w", name, c.explain(err))
		}
		if !r.won {
			if held = r.held; held != nil && r.live {
				return nil, held
			}
			continue // freed between the two statements, or an insert race
		}
		l = newLease(c, s, name, fence.Token(token), secret)
		if !c.track(l) {
			// Closed, or the session ended: give it straight back.
			c.freeBySecret(ctx, name, secret, token)
			if _, closed := c.state(); closed {
				return nil, ErrClosed
			}
			continue
		}
		if s.generation() != seen {
			// A renewal read the session's losses without this lease:
			// it may be one of them.
			if err := l.Check(ctx); err != nil {
				_ = l.Release(ctx)
				if errors.Is(err, ErrLeaseLost) {
					continue // never handed out: try again
				}
				return nil, fmt.Errorf("lock: acquire %q: %w", name, err)
			}
		}
		if s.left(c.clock.Now()) < c.cfg.RenewInterval {
			// Back late: renew the session (which ends the lease if taken).
			if _, err := c.liveSession(ctx); err != nil {
				_ = l.Release(ctx)
				return nil, fmt.Errorf("lock: acquire %q: renew the session after a late acquisition: %w", name, c.explain(err))
			}
			if l.Err() != nil {
				continue // lost while it came back: never handed out
			}
		}
		if !l.handOut() {
			continue // lost meanwhile: try again
		}
		return l, nil
	}
	if held != nil {
		return nil, held
	}
	return nil, fmt.Errorf("lock: acquire %q: %w", name, errRowChanging)
}

// freeBySecret frees the lease name this acquisition won but does not hand
// out (in the background once ctx has ended).
func (c *Client) freeBySecret(ctx context.Context, name string, secret []byte, token int64) {
	what := fmt.Sprintf("free acquisition %q", name)
	free := func(ctx context.Context) error {
		_, err := c.pool.Exec(ctx, c.q.releaseSecret, name, secret)
		return err
	}
	if ctx.Err() != nil {
		c.handOff(ctx, what, free)
	} else if err := c.cleanup(ctx, what, free); err != nil {
		c.log.Warn("pgfence: could not free an acquisition not handed out; it expires with its session",
			"lease", name, "token", token, "err", err)
	}
}

// casResult is what one attempt found.
type casResult struct {
	won     bool       // the lease was won
	held    *HeldError // otherwise, the row as heldBy saw it (nil: try again)
	live    bool       // the row is held by a live session
	mine    bool       // the row holds the caller's secret
	session int64      // the session the row names (0: none)
}

// attempt is one compare-and-set for session s, on one connection: acquire,
// then heldBy if it did not win, then takeOver if the row names an expired
// session, or acquireNew if there is no row. It returns the lease won
// (r.won, token), or the row as it stands (r.held; nil: try again).
func (c *Client) attempt(ctx context.Context, name string, secret []byte, s *session) (token int64, r casResult, err error) {
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return 0, casResult{}, err
	}
	defer conn.Release()
	pid := conn.Conn().PgConn().PID()
	args := []any{name, c.cfg.Holder, secret, s.id}
	// cas runs acquire or takeOver, which may wait on the row for a holder
	// frozen in a guarded transaction (package idleholder).
	cas := func(sql string) (bool, error) {
		stop := func() {}
		if c.cfg.IdleHolderAfter > 0 {
			var waiter *int64 // the acquisition's backend, if the client knows it (verify)
			if backend := int64(pid); c.backendPIDs.Load() {
				waiter = &backend
			}
			stop = c.watchIdleHolders(ctx, name, waiter)
		}
		err := conn.QueryRow(ctx, sql, args...).Scan(&token, nil) // the last column: whether an observer was told
		stop()
		if errors.Is(err, pgx.ErrNoRows) {
			return false, nil
		}
		return err == nil, inFlight(err, conn.Conn().PgConn())
	}
	if won, err := cas(c.q.acquire); won || err != nil {
		return token, casResult{won: won}, err
	}
	var (
		h        = &HeldError{Name: name}
		inMicros int64
	)
	err = conn.QueryRow(ctx, c.q.heldBy, name, secret).Scan(&h.Token, &h.Holder, &r.live, &h.ExpiresAt, &inMicros, &r.mine, &r.session)
	switch {
	case errors.Is(err, pgx.ErrNoRows): // the name's first acquisition
		err := conn.QueryRow(ctx, c.q.acquireNew, args...).Scan(&token)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, casResult{}, nil // another was first
		}
		return token, casResult{won: err == nil}, inFlight(err, conn.Conn().PgConn())
	case err != nil:
		return 0, casResult{}, err
	}
	h.ExpiresIn = time.Duration(inMicros) * time.Microsecond
	r.held = h
	switch {
	case r.mine && r.live && r.session == s.id:
		// An earlier attempt of this Acquire won; its reply was lost.
		c.log.Info("pgfence: adopted a lease whose acquisition reply was lost", "lease", name, "token", h.Token)
		return int64(h.Token), casResult{won: true}, nil
	case r.mine && r.live:
		// Won by an earlier attempt under a session that has ended: free
		// it, and try again.
		_, err := conn.Exec(ctx, c.q.releaseSecret, name, secret)
		return 0, casResult{}, err
	case r.live || r.session == 0:
		return 0, r, nil
	}
	// Named by an expired session: take it over (if it was renewed or
	// taken meanwhile, the caller looks again).
	if won, err := cas(c.q.takeOver); won || err != nil {
		return token, casResult{won: won}, err
	}
	return 0, r, nil
}

// Acquire blocks until it acquires the lease name or ctx ends (then it
// returns ctx's error). It wakes within milliseconds of a release
// (LISTEN/NOTIFY), and otherwise polls (Config.PollInterval). A permanent
// error ends it; a transient one is retried with backoff (the package
// documentation). An attempt whose reply was lost is adopted by the next;
// if Acquire gives up instead, that lease is freed in the background.
func (c *Client) Acquire(ctx context.Context, name string) (l *Lease, err error) {
	if err := ctxcheck.NotNil(ctx, "lock: Acquire"); err != nil {
		return nil, err
	}
	if err := fence.ValidateName(name); err != nil {
		return nil, err
	}
	var w *notify.Sub
	secret, began := newSecret(), time.Now()
	var (
		doubt bool   // some attempt's outcome is unknown
		pid   uint32 // the backend of the last such attempt
	)
	defer func() {
		if w != nil {
			w.Cancel()
		}
		if err != nil && doubt {
			c.abandon(name, secret, pid)
		}
	}()
	var (
		failing retry.Failing
		last    error // the last failure of the current failure period
	)
	// gaveUp is ctx's error, with the last failure if attempts were
	// failing rather than waiting for a holder.
	gaveUp := func() error {
		if last == nil {
			return ctx.Err()
		}
		return fmt.Errorf("lock: acquire %q: %w; the attempts were failing (%d), the last with: %w", name, ctx.Err(), failing.Count(), last)
	}
	for {
		// An attempt cut short may have been granted: the next adopts it.
		actx, cancelAttempt := context.WithTimeout(ctx, c.attemptBound())
		l, err := c.tryAcquire(actx, name, secret)
		cut := actx.Err() != nil && ctx.Err() == nil
		cancelAttempt()
		if p, ok := inDoubt(err); ok {
			doubt, pid = true, p
		}
		if !errors.Is(err, ErrHeld) {
			switch {
			case err == nil:
				failing.Recover(c.log, "pgfence: acquire recovered", "lease", name)
				c.m.waitTime.Record(ctx, time.Since(began).Seconds())
				return l, nil
			case ctx.Err() != nil:
				if !errors.Is(err, ctx.Err()) {
					last = err
				}
				return nil, gaveUp()
			case cut: // the attempt's own bound: tried again
			case errors.Is(err, ErrClosed) || !(retry.Transient(err) || errors.Is(err, ErrTryAgain)):
				return nil, err
			}
			last = err
			failing.Fail(c.log, "pgfence: acquire failing; retrying with backoff", err, "lease", name)
			// A release or a poll during the backoff ends it: the
			// database answers again.
			if !backoffOrWake(ctx, c.backoff.Wait(failing.Count()-1), w) {
				return nil, gaveUp()
			}
			continue
		}
		failing.Recover(c.log, "pgfence: acquire recovered", "lease", name)
		last = nil // held by another: waiting, not failing
		// Waiting: listen for releases, then ask the poller, which asks
		// the holder's release to NOTIFY and then wakes w: the next
		// attempt catches a release before the request, the NOTIFY one
		// after it.
		if w == nil {
			w = c.waits.Subscribe(name)
			select {
			case <-w.Ready:
			case <-time.After(c.cfg.PollInterval):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			w.Poll()
		}
		select {
		case <-w.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

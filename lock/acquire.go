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
	"github.com/pgfence/pgfence/internal/retry"
)

// Acquisitions: one attempt (TryAcquire), and the waiting loop (Acquire).

// TryAcquire acquires the lease name if it is free or was released (one
// round trip), or if its holder's session has expired at the database (a
// takeover: two more, the second locking the session's row); otherwise it
// returns a *HeldError. The lease belongs to the client's session, which
// the client starts on its first acquisition (and again after one ended).
// The new lease's token is greater than every token issued for name before.
//
// The client's first acquisition checks that the schema is migrated and
// returns a *migrations.NotMigratedError if not. If ctx ends while the
// acquisition is in flight, the database may still have granted it: the
// client then frees that lease in the background (by its secret, which
// only this attempt knows), so nothing is left held by nobody.
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

// attemptBound bounds one attempt of a blocking Acquire: two TTLs plus
// PollInterval, past the longest an attempt waits for a frozen holder's
// guarded transaction before the takeover ends it (TTL + PollInterval + a
// small bound, the package documentation).
func (c *Client) attemptBound() time.Duration { return 2*c.cfg.TTL + c.cfg.PollInterval }

// newSecret returns a fresh per-acquisition secret.
func newSecret() []byte {
	secret := make([]byte, 16)
	_, _ = cryptorand.Read(secret)
	return secret
}

// backoffOrWake waits d, or less if a release of the lease is announced
// (sub) or the poller finds it free or expired (w), either of which may
// be nil; it returns false if ctx ends first.
func backoffOrWake(ctx context.Context, d time.Duration, sub *subscription, w *waiter) bool {
	var released, polled <-chan struct{}
	if sub != nil {
		released = sub.C
	}
	if w != nil {
		polled = w.C
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	case <-released:
	case <-polled:
	}
	return true
}

// errRowChanging is returned when three attempts in a row found the row
// changed between the acquisition and the look-up that followed it, or
// lost the lease they had won before it could be handed out.
var errRowChanging = fmt.Errorf("%w: the row kept changing under three attempts", ErrTryAgain)

// tryAcquire is TryAcquire with a given secret. Blocking Acquire keeps one
// secret across its attempts, so that when an attempt's reply is lost (its
// connection dropped after the commit) a later attempt finds the row holding
// its own secret and adopts the lease instead of waiting for it to expire.
//
// A lease is returned only with at least one RenewInterval of its session's
// trust window left: the session is renewed first if it has less, and again
// after an acquisition that took long to come back (it waited behind a
// guarded transaction, or the process was paused).
func (c *Client) tryAcquire(ctx context.Context, name string, secret []byte) (l *Lease, err error) {
	defer func() {
		c.m.attempted(ctx, err)
		if l != nil {
			l.announce()
		}
	}()
	if c.isClosed() {
		return nil, ErrClosed
	}
	if err := c.verify(ctx); err != nil {
		return nil, err
	}
	var held *HeldError
	req := acquisition{name: name, secret: secret}
	for attempt := 0; ; attempt++ {
		if attempt == 3 {
			if held != nil {
				return nil, held
			}
			return nil, fmt.Errorf("lock: acquire %q: %w", name, errRowChanging)
		}
		s, err := c.liveSession(ctx)
		if err != nil {
			if errors.Is(err, ErrClosed) {
				return nil, err
			}
			return nil, fmt.Errorf("lock: acquire %q: %w", name, c.explain(err))
		}
		seen := s.generation()
		token, r, err := c.attempt(ctx, req, s)
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
			// The client closed, or the session ended, while acquiring:
			// give the lease straight back, by its secret.
			c.freeBySecret(ctx, name, secret, token)
			if c.isClosed() {
				return nil, ErrClosed
			}
			continue
		}
		if s.generation() != seen {
			// A renewal read which of the session's leases were lost
			// while this acquisition was in flight, before this one was
			// tracked: it may be one of them (freed or revoked at once).
			if err := l.Check(ctx); err != nil {
				_ = l.Release(ctx)
				if errors.Is(err, ErrLeaseLost) {
					// Lost before it was handed out (expired, freed,
					// or its session ended meanwhile): try again.
					continue
				}
				return nil, fmt.Errorf("lock: acquire %q: %w", name, err)
			}
		}
		if s.left(c.clock.Now()) >= c.cfg.RenewInterval {
			if !l.handOut() {
				continue // lost meanwhile: try again
			}
			return l, nil
		}
		// The acquisition came back late: renew the session before the
		// lease is handed out (the renewal ends it if it was taken).
		if _, err := c.liveSession(ctx); err != nil {
			_ = l.Release(ctx)
			return nil, fmt.Errorf("lock: acquire %q: renew the session after a late acquisition: %w", name, c.explain(err))
		}
		if l.Err() != nil {
			// Lost while this acquisition came back (the session ran out
			// of trust and the renewal just now started another, or the
			// renewal found the lease expired or freed): it was never
			// handed out; try again.
			continue
		}
		if !l.handOut() {
			continue
		}
		return l, nil
	}
}

// freeBySecret frees the lease name that this acquisition (its secret)
// won but does not hand out, in the background once ctx has ended. What is
// not freed expires with the session, by the database clock.
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

// acquisition is what one Acquire asks for: the name and its secret.
type acquisition struct {
	name   string
	secret []byte
}

// args are the acquire and acquireNew statements' arguments.
func (a acquisition) args(c *Client, s *session) []any {
	return []any{a.name, c.cfg.Holder, a.secret, s.id}
}

// attempt is one compare-and-set (and, for a name never acquired, the
// insert) for session s. r.won says whether the lease was won (token is
// then set); otherwise r.held is the row as it stands (nil when an insert
// lost a race, or an earlier attempt's win was freed: try again).
func (c *Client) attempt(ctx context.Context, req acquisition, s *session) (token int64, r casResult, err error) {
	name := req.name
	r, err = c.compareAndSet(ctx, req, s, &token)
	switch {
	case err != nil || r.won:
		return token, r, err
	case r.held != nil && r.mine && r.live && r.session == s.id:
		// An earlier attempt of this Acquire won; its reply was lost.
		c.log.Info("pgfence: adopted a lease whose acquisition reply was lost", "lease", name, "token", r.held.Token)
		return int64(r.held.Token), casResult{won: true}, nil
	case r.held != nil && r.mine && r.live:
		// Won by an earlier attempt under a session that has ended here
		// since: free it (the secret is this Acquire's), and try again.
		_, err := c.pool.Exec(ctx, c.q.releaseSecret, name, req.secret)
		return 0, casResult{}, err
	case r.held != nil:
		return token, r, nil
	}
	// No row yet: this is the name's first acquisition, unless someone
	// else inserts it first (no row returned); then try again.
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return token, casResult{}, err
	}
	defer conn.Release()
	err = conn.QueryRow(ctx, c.q.acquireNew, req.args(c, s)...).Scan(&token)
	if errors.Is(err, pgx.ErrNoRows) {
		return token, casResult{}, nil
	}
	return token, casResult{won: err == nil}, inFlight(err, conn.Conn().PgConn().PID())
}

// casResult is what one compare-and-set round trip found.
type casResult struct {
	won     bool       // the acquire statement took the lease
	held    *HeldError // otherwise, the row as heldBy saw it (nil: no row)
	live    bool       // the row is held by a live session
	mine    bool       // the row holds the caller's secret
	session int64      // the session the row names (0: none)
}

// compareAndSet sends the acquire statement and, if it did not win, heldBy;
// and if that finds the row named by an expired session, the takeover. It
// reports whether the lease was won (filling token), or else the row as it
// stands, if there is one.
func (c *Client) compareAndSet(ctx context.Context, req acquisition, s *session, token *int64) (casResult, error) {
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return casResult{}, err
	}
	defer conn.Release()
	// cas runs one compare-and-set statement; the statement may wait on
	// the row for a holder frozen in a guarded transaction (idleholders.go).
	cas := func(sql string) error {
		stop := func() {}
		if c.cfg.IdleHolderAfter > 0 {
			var waiter *int64 // the acquisition's backend, if the client knows it (verify)
			if c.backendPIDs.Load() {
				pid := int64(conn.Conn().PgConn().PID())
				waiter = &pid
			}
			stop = c.watchIdleHolders(ctx, req.name, waiter)
		}
		err := conn.QueryRow(ctx, sql, req.args(c, s)...).Scan(token, nil) // the last column: whether an observer was told
		stop()
		return err
	}
	err = cas(c.q.acquire)
	switch {
	case err == nil:
		return casResult{won: true}, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return casResult{}, inFlight(err, conn.Conn().PgConn().PID())
	}
	var (
		r        casResult
		h        = &HeldError{Name: req.name}
		inMicros int64
	)
	err = conn.QueryRow(ctx, c.q.heldBy, req.name, req.secret).Scan(&h.Token, &h.Holder, &r.live, &h.ExpiresAt, &inMicros, &r.mine, &r.session)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return casResult{}, nil
	case err != nil:
		return casResult{}, err
	}
	h.ExpiresIn = time.Duration(inMicros) * time.Microsecond
	r.held = h
	if r.live || r.session == 0 {
		return r, nil
	}
	// Named by an expired session: take it over.
	switch err := cas(c.q.takeOver); {
	case err == nil:
		return casResult{won: true}, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return casResult{}, inFlight(err, conn.Conn().PgConn().PID())
	}
	return r, nil // renewed meanwhile, or taken by someone else: the caller looks again
}

// Acquire blocks until it acquires the lease name or ctx ends. It wakes
// within milliseconds of a release (LISTEN/NOTIFY) and otherwise retries
// every PollInterval (jittered), or sooner when the holder's lease is due to
// expire. It returns ctx's error when ctx ends first.
//
// Errors are classified (see the package documentation): a permanent one (a
// schema that is missing or too old, missing privileges) ends Acquire with
// that error at once; a transient one (a lost connection, a failover) is
// retried with capped exponential backoff and jitter, logged once when
// acquisitions start failing and once when they recover. If an attempt won
// the lease but its reply was lost, a later attempt recognises the lease as
// its own (Acquire keeps one secret across attempts) and returns it, trusted
// from the first attempt's send time, instead of waiting for it to expire;
// if Acquire gives up instead, it frees that lease in the background.
func (c *Client) Acquire(ctx context.Context, name string) (l *Lease, err error) {
	if err := ctxcheck.NotNil(ctx, "lock: Acquire"); err != nil {
		return nil, err
	}
	if err := fence.ValidateName(name); err != nil {
		return nil, err
	}
	var (
		sub *subscription
		w   *waiter
	)
	secret, began := newSecret(), time.Now()
	var (
		doubt bool   // some attempt's outcome is unknown
		pid   uint32 // the backend of the last such attempt
	)
	defer func() {
		if sub != nil {
			sub.cancel()
		}
		if w != nil {
			c.poll.remove(w)
		}
		if err != nil && doubt {
			c.abandon(name, secret, pid)
		}
	}()
	var (
		failing retry.Failing
		last    error // the last failure of the current failure period
	)
	// gaveUp is ctx's error, with the failure that kept Acquire from the
	// lease when attempts were failing (a refused connection, a failover)
	// rather than waiting for a holder: a bare "context deadline exceeded"
	// would hide it.
	gaveUp := func() error {
		if last == nil {
			return ctx.Err()
		}
		return fmt.Errorf("lock: acquire %q: %w; the attempts were failing (%d), the last with: %w", name, ctx.Err(), failing.Count(), last)
	}
	for {
		// Each attempt has a bound of its own, attemptBound: one sent into a
		// network partition would otherwise wait, once the network heals,
		// for TCP's next retransmission (seconds, growing with the
		// partition's length) while the release it waits for has long been
		// announced. An attempt cut short may have been granted: the next
		// one, with the same secret, adopts it.
		actx, cancelAttempt := context.WithTimeout(ctx, c.attemptBound())
		l, err := c.tryAcquire(actx, name, secret)
		cut := actx.Err() != nil && ctx.Err() == nil
		cancelAttempt()
		if p, ok := inDoubt(err); ok {
			doubt, pid = true, p
		}
		var held *HeldError
		if !errors.As(err, &held) {
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
			// A release (or the poller) that comes during the backoff
			// wakes it: the database answers again, and the lease may be
			// free (a waiter cut off by a partition otherwise slept up to
			// a PollInterval past the release that followed the heal).
			if !backoffOrWake(ctx, c.backoff.Wait(failing.Count()-1), sub, w) {
				return nil, gaveUp()
			}
			continue
		}
		failing.Recover(c.log, "pgfence: acquire recovered", "lease", name)
		last = nil // held by another: waiting, not failing
		// Waiting: subscribe to releases (once), then register with the
		// poller, which asks the holder's release to send a NOTIFY and
		// wakes w once that is done: the next attempt catches a release
		// that came before the request, the NOTIFY one after it. From then
		// on w wakes when the poller finds the lease free or expired, and
		// sub when it is released.
		if sub == nil {
			sub = c.lis.subscribe(name)
			select {
			case <-sub.ready:
			case <-time.After(c.cfg.PollInterval):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			w = c.poll.add(name)
		}
		select {
		case <-sub.C:
		case <-w.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

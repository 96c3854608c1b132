package lock

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/retry"
)

// session is a client's liveness at the database: one row of
// pgfence_sessions that every lease it holds names (00005_sessions.sql).
// When it ends, every lease of it ends. The trust window is the session's
// (the package documentation).
type session struct {
	c  *Client
	id int64

	mu         sync.Mutex
	trustUntil time.Time // local monotonic clock
	expiresAt  time.Time // database clock
	losses     int64     // the loss count the last reconciled renewal saw
	timeline   int64     // the server's timeline at the last renewal (or the start)
	gen        uint64    // reconciliations begun: an acquisition in flight across one checks its lease
	leases     map[*Lease]struct{}
	timer      clock.Timer
	ended      bool
}

// errSessionExpired: a renewal found the session expired.
var errSessionExpired = errors.New("the session expired at the database")

// left is how much of s's trust window remains at now (0 once ended).
func (s *session) left(now time.Time) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return 0
	}
	return s.trustUntil.Sub(now)
}

func (s *session) generation() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gen
}

func (s *session) isEnded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ended
}

// add tracks l in s, unless s has ended.
func (s *session) add(l *Lease) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ended {
		return false
	}
	s.leases[l] = struct{}{}
	return true
}

// remove stops tracking l, and reports how many leases s still holds.
func (s *session) remove(l *Lease) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.leases, l)
	return len(s.leases)
}

func (s *session) held() []*Lease {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Collect(maps.Keys(s.leases))
}

func (s *session) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.leases)
}

// end ends s and loses its leases for cause, or for why's, where known.
func (s *session) end(cause LossCause, err error, why map[*Lease]loss) {
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended = true
	s.timer.Stop()
	leases := slices.Collect(maps.Keys(s.leases))
	s.mu.Unlock()
	s.c.mu.Lock()
	if s.c.sess == s {
		s.c.sess = nil
	}
	s.c.mu.Unlock()
	for _, l := range leases {
		if w, ok := why[l]; ok {
			l.lose(w.cause, w.err)
		} else {
			l.lose(cause, fmt.Errorf("%w: %q: %w", ErrLeaseLost, l.name, err))
		}
	}
}

// trustElapsed ends s when its trust window's timer fires, unless a
// renewal has just moved the window.
func (s *session) trustElapsed() {
	s.mu.Lock()
	if s.ended || s.c.clock.Now().Before(s.trustUntil) {
		s.mu.Unlock()
		return
	}
	until := s.trustUntil
	s.mu.Unlock()
	cause := CauseExpired
	if s.c.failing.Load() {
		cause = CauseUnreachable
	}
	s.end(cause, fmt.Errorf("not renewed within its trust window (until %s)", until.Format(time.RFC3339Nano)), nil)
}

// renewed extends s's trust window after a successful renewal sent at
// sent, and returns what was left of it.
func (s *session) renewed(sent, expiresAt time.Time, losses, timeline int64) (left time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.c.clock.Now()
	left = s.trustUntil.Sub(now)
	if s.ended {
		return left
	}
	s.expiresAt, s.losses, s.timeline = expiresAt, max(s.losses, losses), timeline
	if until := s.c.cfg.window().extend(s.trustUntil, sent); until != s.trustUntil {
		s.trustUntil = until
		s.timer.Reset(until.Sub(now))
	}
	return left
}

// loss is why one lease was lost.
type loss struct {
	cause LossCause
	err   error
}

func (c *Client) startSession(ctx context.Context) error {
	sent := c.clock.Now()
	s := &session{c: c, leases: make(map[*Lease]struct{})}
	if err := c.pool.QueryRow(ctx, c.q.startSession, c.cfg.Holder, c.cfg.TTL.Microseconds()).Scan(&s.id, &s.expiresAt, &s.timeline); err != nil {
		return fmt.Errorf("lock: start a session: %w", c.explain(err))
	}
	s.trustUntil = c.cfg.window().until(sent)
	// A window already over fires at once: mu holds it off until s.timer
	// is set.
	s.mu.Lock()
	s.timer = c.clock.AfterFunc(s.trustUntil.Sub(c.clock.Now()), s.trustElapsed)
	s.mu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		s.mu.Lock()
		s.ended = true
		s.timer.Stop()
		s.mu.Unlock()
		return ErrClosed
	}
	c.sess = s
	return nil
}

// liveSession returns the client's session with at least one RenewInterval
// of trust left, renewing it first if it has less, or starting one if there
// is none (or it has ended).
func (c *Client) liveSession(ctx context.Context) (*session, error) {
	for {
		s, closed := c.state()
		switch {
		case closed:
			return nil, ErrClosed
		case s != nil && s.left(c.clock.Now()) >= c.cfg.RenewInterval:
			return s, nil
		}
		select {
		case <-c.turn:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		var err error
		left := time.Duration(0)
		if s, _ = c.state(); s != nil {
			left = s.left(c.clock.Now())
		}
		// A renewal gets the trust left, a start a trust window: past
		// them the session would be over anyway.
		bound := left
		if left <= 0 {
			bound = c.cfg.TTL - c.cfg.SafetyMargin
		}
		tctx, cancel := context.WithTimeout(ctx, bound)
		// Less than a RenewInterval left: renew; none (or expired at the
		// database): start anew; more: renewed or started while this
		// call waited its turn.
		if 0 < left && left < c.cfg.RenewInterval {
			err = c.renewSession(tctx, c.pool, s)
		}
		if left <= 0 || errors.Is(err, errSessionExpired) {
			err = c.startSession(tctx)
		}
		cut := tctx.Err() != nil && ctx.Err() == nil
		cancel()
		c.turn <- struct{}{}
		if cut { // the session's bound, not the caller's: try again
			return nil, fmt.Errorf("%w (after %v: %v)", errSessionSlow, bound, err)
		}
		if err != nil {
			return nil, err
		}
	}
}

// errSessionSlow: an acquisition's renewal or start of the session
// outlasted its bound.
var errSessionSlow = fmt.Errorf("%w: the session's renewal or start outlasted its bound", ErrTryAgain)

// renewSession renews s on q; the caller holds the turn. If the loss
// count or the timeline moved, it first ends the leases the database no
// longer counts as s's, and if it cannot read which, it does not extend
// the window.
func (c *Client) renewSession(ctx context.Context, q fence.DB, s *session) error {
	var (
		exp              time.Time
		losses, timeline int64
	)
	sent := c.clock.Now() // the trust window counts from here
	began := time.Now()
	err := q.QueryRow(ctx, c.q.renew, s.id, c.cfg.TTL.Microseconds()).Scan(&exp, &losses, &timeline)
	got := time.Now()
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		why, _ := c.reconcile(ctx, q, s)
		s.end(CauseExpired, errSessionExpired, why)
		return errSessionExpired
	case err != nil:
		return err
	}
	s.mu.Lock()
	moved := losses != s.losses || timeline != s.timeline
	s.mu.Unlock()
	if moved {
		why, err := c.reconcile(ctx, q, s)
		if err != nil {
			return fmt.Errorf("read the leases taken from the session: %w", err)
		}
		for l, w := range why {
			l.lose(w.cause, w.err)
		}
	}
	rtt := c.stats.observe(began, got, exp.Add(-c.cfg.TTL)) // expires_at = the statement's now() + TTL
	c.m.renewTime.Record(ctx, rtt.Seconds())
	c.watchSkew()
	left := s.renewed(sent, exp, losses, timeline)
	c.m.timeLeft.Record(context.Background(), max(left, 0).Seconds())
	if left < c.cfg.RenewInterval {
		for _, l := range s.held() {
			if l.isOut() { // not one an acquisition has yet to hand out
				c.emit(Event{Kind: RenewedLate, Lease: l.name, Token: l.token, TimeLeft: left})
			}
		}
	}
	return nil
}

// reconcile reads which of s's leases the database no longer counts as
// s's, and why.
func (c *Client) reconcile(ctx context.Context, q fence.DB, s *session) (map[*Lease]loss, error) {
	s.mu.Lock()
	s.gen++ // under the lock add takes: a lease tracked later sees it, and checks itself
	leases := slices.Collect(maps.Keys(s.leases))
	s.mu.Unlock()
	byName := make(map[string]*Lease, len(leases))
	for _, l := range leases {
		byName[l.name] = l
	}
	names, tokens, secrets := identify(leases)
	rows, err := q.Query(ctx, c.q.reconcile, names, tokens, secrets, s.id)
	if err != nil {
		return nil, err
	}
	why := make(map[*Lease]loss)
	var (
		name      string
		token     int64
		ours      bool
		live      bool
		expiresAt time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&name, &token, &ours, &live, &expiresAt}, func() error {
		l := byName[name]
		if l == nil {
			return nil
		}
		cause, lerr := l.judge(token, ours, live, expiresAt)
		if lerr == nil {
			cause, lerr = CauseRenewFailed, fmt.Errorf("%w: %q (token %d) is no longer the session's", ErrLeaseLost, l.name, l.token)
		}
		why[l] = loss{cause, lerr}
		return nil
	})
	return why, err
}

// identify returns the statements' arrays of leases: names, tokens and
// secrets.
func identify(leases []*Lease) (names []string, tokens []int64, secrets [][]byte) {
	for _, l := range leases {
		names, tokens, secrets = append(names, l.name), append(tokens, int64(l.token)), append(secrets, l.secret)
	}
	return names, tokens, secrets
}

// sessionLinger is how long the renewer keeps the client's session after
// its last lease ended: a client that acquires now and then keeps one
// session row (rows are never deleted), for a statement per RenewInterval.
const sessionLinger = 5 * time.Minute

// renewLoop renews the client's session once per RenewInterval (send to
// send) until ctx ends; a failed renewal is retried after a quarter
// interval. Renewals go over a connection of the renewer's own, so that a
// busy pool cannot cost a lease, or, when it does not open within half an
// interval (ownconn.Link), over an idle pooled one.
func (c *Client) renewLoop(ctx context.Context) {
	own := ownconn.NewLink(ctx, c.pool, c.cfg.TTL)
	defer own.Close()
	again := retry.Backoff{Base: c.cfg.RenewInterval / 4, Max: c.cfg.RenewInterval / 4}
	var failing retry.Failing // logs once per failure period
	tick := make(chan struct{}, 1)
	t := c.clock.AfterFunc(c.firstRenewal(), func() {
		select {
		case tick <- struct{}{}:
		default:
		}
	})
	defer t.Stop()
	for {
		select {
		case <-tick:
		case <-ctx.Done():
			return
		}
		wait := c.cfg.RenewInterval
		if s, _ := c.state(); s != nil {
			sent := c.clock.Now()
			err := c.renewTurn(ctx, own, s)
			if ctx.Err() != nil {
				return
			}
			took := c.clock.Now().Sub(sent)
			wait = max(c.cfg.RenewInterval-took, 0)
			c.watchRenewLatency(took, s.count())
			switch {
			case err == nil:
				failing.Recover(c.log, "pgfence: renewals healthy again", "leases", s.count())
				c.failing.Store(false)
			case s.count() == 0:
				// Lingering with no lease: nothing to lose, nothing to
				// alert on; the next acquisition renews or starts anew.
			case errors.Is(err, errSessionExpired):
				// Not a failure to reach the database: its leases are
				// lost, each with its cause.
				c.failing.Store(false)
			default:
				c.stats.failures.Add(1)
				failing.Fail(c.log, "pgfence: renewals failing; leases end at their trust deadline unless one succeeds",
					err, "leases", s.count())
				c.failing.Store(true)
				wait = again.Wait(failing.Count() - 1)
			}
		}
		t.Reset(wait)
	}
}

// firstRenewal is when a starting renewer first renews: a RenewInterval
// after the session's last renewal was sent (its trust window tells when).
func (c *Client) firstRenewal() time.Duration {
	s, _ := c.state()
	if s == nil {
		return c.cfg.RenewInterval
	}
	return max(s.left(c.clock.Now())-(c.cfg.TTL-c.cfg.SafetyMargin-c.cfg.RenewInterval), 0)
}

// renewTurn renews s over own once it has the turn, within s's trust
// window (at least a RenewInterval, for a reconnect after a failover).
func (c *Client) renewTurn(ctx context.Context, own *ownconn.Link, s *session) error {
	budget := max(c.cfg.RenewInterval, s.left(c.clock.Now()))
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	select {
	case <-c.turn:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { c.turn <- struct{}{} }()
	if s.isEnded() {
		return nil
	}
	return own.Do(ctx, c.cfg.RenewInterval/2, func(ctx context.Context, q pgexec.DB) error {
		if s.isEnded() { // ended while Do waited for a connection
			return nil
		}
		return c.renewSession(ctx, q, s)
	})
}

// slowRenewal is the fraction of RenewInterval past which a renewal is
// slow: a little slower, and it eats into the SafetyMargin.
const slowRenewal = 0.5

// watchRenewLatency counts a slow renewal, and logs once when renewals
// become slow and once when they are fast again.
func (c *Client) watchRenewLatency(took time.Duration, leases int) {
	slow := took > time.Duration(slowRenewal*float64(c.cfg.RenewInterval))
	if slow {
		c.stats.slow.Add(1)
		c.m.slowRenewal()
	}
	if c.stats.renewSlow.Swap(slow) == slow {
		return
	}
	if slow {
		c.log.Warn("pgfence: renewals take more than half of RenewInterval; if they slow further the leases end "+
			"at their trust deadline: relieve the server or the network, or give the client a longer TTL",
			"latency", took, "renew_interval", c.cfg.RenewInterval, "leases", leases)
	} else {
		c.log.Info("pgfence: renewals fast again", "latency", took, "leases", leases)
	}
}

package lock

import (
	"context"
	"errors"
	"fmt"
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
// pgfence_sessions that the client renews, and that every lease it holds
// names (00005_sessions.sql). A renewal costs one statement whatever the
// number of leases; when the session ends, every lease of it ends.
//
// The trust window is the session's: until the send time of its last
// successful renewal (or of its start) + TTL - SafetyMargin. A renewal
// returns the count of the session's leases taken from it (a takeover
// after expiry, ForceRelease, a revocation); when the count has moved, the
// renewal reads which ones before it extends the window for the others.
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

// errSessionExpired: the renewal found the session expired (or gone) at
// the database.
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

// generation counts the reconciliations begun: one that began while an
// acquisition was in flight read the session's leases without it.
func (s *session) generation() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.gen
}

// isEnded reports whether s has ended.
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

// held returns s's leases.
func (s *session) held() []*Lease {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Lease, 0, len(s.leases))
	for l := range s.leases {
		out = append(out, l)
	}
	return out
}

// count is the number of leases s holds.
func (s *session) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.leases)
}

// end ends s: it is renewed no more and the client starts another for its
// next acquisition; every lease of it is lost for cause (why, per lease,
// when known: a reconciliation read the rows).
func (s *session) end(cause LossCause, err error, why map[*Lease]loss) {
	s.mu.Lock()
	if s.ended {
		s.mu.Unlock()
		return
	}
	s.ended = true
	s.timer.Stop()
	leases := make([]*Lease, 0, len(s.leases))
	for l := range s.leases {
		leases = append(leases, l)
	}
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

// trustElapsed runs when the trust window's timer fires. A renewal may
// have moved the window while the timer was firing; then it has been reset.
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
// sent, which found the loss count losses (the leases lost since the last
// one have been ended by then).
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

// startSession inserts a new session row for the client, and makes it the
// client's session.
func (c *Client) startSession(ctx context.Context) (*session, error) {
	sent := c.clock.Now()
	s := &session{c: c, leases: make(map[*Lease]struct{})}
	if err := c.pool.QueryRow(ctx, c.q.startSession, c.cfg.Holder, c.cfg.TTL.Microseconds()).Scan(&s.id, &s.expiresAt, &s.timeline); err != nil {
		return nil, fmt.Errorf("lock: start a session: %w", c.explain(err))
	}
	s.trustUntil = c.cfg.window().until(sent)
	// The window may already be over (the process was paused while the
	// statement was in flight): then the timer fires at once, and must
	// find s.timer set. Holding mu makes it wait for the assignment.
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
		return nil, ErrClosed
	}
	c.sess = s
	return s, nil
}

// liveSession returns the client's session with at least one RenewInterval
// of trust left, renewing it first if it has less, or starting one if there
// is none (or it has ended).
func (c *Client) liveSession(ctx context.Context) (*session, error) {
	for {
		c.mu.Lock()
		s, closed := c.sess, c.closed
		c.mu.Unlock()
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
		c.mu.Lock()
		s = c.sess
		c.mu.Unlock()
		// The turn is the renewer's too: a renewal done under it is
		// bound as the renewer's own is (renewTurn), whatever ctx allows.
		var err error
		left := time.Duration(0)
		if s != nil {
			left = s.left(c.clock.Now())
		}
		// A renewal gets the trust left (past it the session is over); a
		// start, a trust window (a session that starts later than that
		// is over when it does; and a start sent into a network
		// partition is given up, and tried again, soon after the heal).
		bound := left
		if left <= 0 {
			bound = c.cfg.TTL - c.cfg.SafetyMargin
		}
		tctx, cancel := context.WithTimeout(ctx, bound)
		switch {
		case left >= c.cfg.RenewInterval:
			// Renewed or started while this call waited its turn.
		case left > 0:
			err = c.renewSession(tctx, c.pool, s)
			if errors.Is(err, errSessionExpired) {
				_, err = c.startSession(tctx)
			}
		default:
			_, err = c.startSession(tctx)
		}
		cut := tctx.Err() != nil && ctx.Err() == nil
		cancel()
		c.turn <- struct{}{}
		if cut {
			// The session's bound, not the caller's deadline: a
			// failure to try again, not a timeout of the caller's.
			return nil, fmt.Errorf("%w (after %v: %v)", errSessionSlow, bound, err)
		}
		if err != nil {
			return nil, err
		}
	}
}

// errSessionSlow is returned when an acquisition's renewal of the session
// took longer than the trust left, or its start longer than a trust
// window: Acquire tries again with backoff.
var errSessionSlow = fmt.Errorf("%w: the session's renewal or start outlasted its bound", ErrTryAgain)

// renewSession renews s on q, once it has the turn (the caller holds it).
// If the loss count moved, it first ends the leases of s that the database
// no longer counts as s's; if it cannot read which, it does not extend the
// window. A session the database found expired ends, with every lease.
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
	// A new timeline: a promotion, after which the newest acquisitions
	// may be missing (asynchronous replication) with no loss counted.
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

// reconcile reads, in one statement, which of s's leases the database no
// longer counts as s's, and why.
func (c *Client) reconcile(ctx context.Context, q fence.DB, s *session) (map[*Lease]loss, error) {
	s.mu.Lock()
	s.gen++ // under the lock add takes: a lease tracked later sees it, and checks itself
	leases := make([]*Lease, 0, len(s.leases))
	for l := range s.leases {
		leases = append(leases, l)
	}
	s.mu.Unlock()
	byName := make(map[string]*Lease, len(leases))
	names := make([]string, len(leases))
	tokens := make([]int64, len(leases))
	secrets := make([][]byte, len(leases))
	for i, l := range leases {
		names[i], tokens[i], secrets[i] = l.name, int64(l.token), l.secret
		byName[l.name] = l
	}
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

// sessionLinger is how long the renewer keeps renewing the client's
// session after its last lease ended (or RenewInterval, if longer): a
// client that acquires now and then keeps one session row, where one that
// starts a session per acquisition would add a row each time (they are
// never deleted: 00005_sessions.sql). It costs one statement per
// RenewInterval meanwhile.
const sessionLinger = 5 * time.Minute

// renewLoop renews the client's session once per RenewInterval (from one
// renewal's send to the next's) until ctx ends. It is the client's renewer
// Demand: wanted while a lease is held, ended once none has been held for
// sessionLinger (a session not renewed then expires on its own; the next
// acquisition starts another). A failed renewal is retried after a quarter
// interval; if none succeeds, the leases end at the trust deadline.
//
// The renewer has a connection of its own (opened with the pool's settings,
// outside it), so that renewals do not wait behind the pool's other users:
// a pool kept busy by jobs, guarded transactions or waiting acquirers must
// not cost a lease. It is opened beside the renewals' path (ownconn.Link):
// a renewal waits half an interval for it, and if it is not open by then
// (new connections stall, as when a busy server's listen queue overflows)
// goes over an idle pooled connection, each try bounded by half an
// interval, within the trust window.
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
		if s := c.session(); s != nil {
			sent := c.clock.Now()
			err := c.renewTurn(ctx, own, s)
			if ctx.Err() != nil {
				return
			}
			// The renewals keep their rate: the next one is sent a
			// RenewInterval after this one was, not after it returned.
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
				// Not a failure to reach the database: the session had
				// expired there (a frozen or partitioned client), and its
				// leases are lost, each with its cause.
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
// after the session's last renewal (or start) was sent, which its trust
// window tells (TTL - SafetyMargin after it), or at once if that is past; a
// RenewInterval from now when there is no session yet.
func (c *Client) firstRenewal() time.Duration {
	s := c.session()
	if s == nil {
		return c.cfg.RenewInterval
	}
	return max(s.left(c.clock.Now())-(c.cfg.TTL-c.cfg.SafetyMargin-c.cfg.RenewInterval), 0)
}

// renewTurn renews s over own once it has the turn, within s's trust window
// (at least one RenewInterval: after a failover it has to connect again,
// and a host that does not answer costs up to connect_timeout).
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

// session returns the client's current session, if any.
func (c *Client) session() *session {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sess
}

// slowRenewal is the fraction of RenewInterval past which a renewal's round
// trip is slow: beyond it, a renewal that slows a little more leaves less
// than the SafetyMargin between the renewals and the end of the trust
// window.
const slowRenewal = 0.5

// watchRenewLatency counts a renewal that took took, and logs once when
// renewals become slow (past slowRenewal of RenewInterval) and once when
// they are fast again.
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

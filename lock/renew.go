package lock

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/retry"
)

// renewLoop renews every held lease once per RenewInterval (from one
// renewal's send to the next's), in one statement per renewChunk leases,
// until ctx ends. It is the client's renewer Demand: wanted while
// a lease is held, ended once none has been held for a whole interval (so
// that a client acquiring and releasing in a loop does not start a
// goroutine each time). A failed renewal is retried after a quarter
// interval; leases whose trust window runs out meanwhile end on their own
// timers. Its pacing is on the real clock, as the database's expiry is.
//
// The renewer has a connection of its own (opened with the pool's settings,
// outside it), so that renewals never wait behind the pool's other users: a
// pool kept busy by jobs, guarded transactions or waiting acquirers must not
// cost a lease.
func (c *Client) renewLoop(ctx context.Context) {
	own := ownconn.New(c.pool)
	defer own.Close()
	// A second connection, opened when a pass has more than one statement
	// (more than renewChunk leases): see renew.
	own2 := ownconn.New(c.pool)
	defer own2.Close()
	// A failed renewal is retried sooner: after a quarter interval, at most.
	again := retry.Backoff{Base: c.cfg.RenewInterval / 4, Max: c.cfg.RenewInterval / 4}
	var failing retry.Failing // logs once per failure period
	// pace is the slowest statement of the last pass: how long each of
	// the next pass's statements is expected to take (see late).
	var pace time.Duration
	t := time.NewTimer(c.cfg.RenewInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
		c.mu.Lock()
		batch := make([]*Lease, 0, len(c.held))
		for l := range c.held {
			batch = append(batch, l)
		}
		c.mu.Unlock()
		wait := c.cfg.RenewInterval
		if len(batch) > 0 {
			c.renewing <- struct{}{}
			// On the group's context: an idle end (ctx) does not cut a
			// renewal in flight; Close still cancels it.
			rctx, stop := context.WithCancel(c.bg.Context())
			c.mu.Lock()
			c.stopRenewal = stop
			c.mu.Unlock()
			sent := time.Now()
			slowest, err := c.renew(rctx, own, own2, batch, pace)
			c.mu.Lock()
			c.stopRenewal = nil
			c.mu.Unlock()
			stop()
			if err == nil {
				pace = slowest
			}
			took := time.Since(sent)
			<-c.renewing
			if ctx.Err() != nil {
				return
			}
			// The renewals keep their rate: the next one is sent a
			// RenewInterval after this one was, not after it returned, so
			// that a slow renewal (many leases, a busy server) does not
			// push the next one past the leases' trust windows.
			wait = max(c.cfg.RenewInterval-took, 0)
			if err == nil {
				c.watchRenewLatency(took, len(batch))
			}
			if err != nil {
				c.stats.failures.Add(1)
				failing.Fail(c.log, "pgfence: renewals failing; leases end at their trust deadlines unless one succeeds",
					err, "leases", len(batch))
				c.failing.Store(true)
				wait = again.Wait(failing.Count() - 1)
			} else {
				failing.Recover(c.log, "pgfence: renewals healthy again", "leases", len(batch))
				c.failing.Store(false)
			}
		}
		t.Reset(wait)
	}
}

// renewKey identifies one acquisition in a renewal's result.
type renewKey struct {
	name  string
	token fence.Token
}

// renewChunk is the most leases one renewal statement renews. A client
// holding more renews them in several statements, in order, on two
// connections at once (q and q2 of renew), each lease's trust window
// counting from its own statement's send: with
// 100,000 leases one statement took 1.5 s on a 2-core machine, and at a
// 3 s TTL a lease renewed back to back by such statements outlived its
// trust window before the next one came back; in chunks, a lease waits
// for one pass over the chunks and its own chunk's round trip.
const renewChunk = 5000

// renew renews batch on q and q2 (two lanes; q alone for one statement),
// in statements of at most renewChunk leases,
// the leases whose trust runs out first in the first statement (so that a
// lease keeps its place from one pass to the next), and returns the
// slowest statement's round trip. Leases the database did not renew
// (taken over, freed, or expired there) are lost; why is read once every
// statement has been sent, so that the looks do not hold back the other
// leases' renewals. pace is how long a statement is expected to take (the
// last pass's slowest), to judge whether the pass is late.
func (c *Client) renew(ctx context.Context, q, q2 fence.DB, batch []*Lease, pace time.Duration) (slowest time.Duration, err error) {
	leases := len(batch)
	until := make(map[*Lease]time.Time, len(batch))
	for _, l := range batch {
		until[l] = l.TrustedUntil()
	}
	slices.SortFunc(batch, func(a, b *Lease) int { return until[a].Compare(until[b]) })
	var missed []*Lease
	defer func() {
		if len(missed) == 0 {
			return
		}
		ctx, cancel := context.WithTimeout(ctx, c.cfg.RenewInterval)
		defer cancel()
		for _, l := range missed {
			if l.Err() == nil { // not released meanwhile (Close)
				l.lose(c.whyNotRenewed(ctx, q, l))
			}
		}
	}()
	// Acquisitions wait while the pass is late (see gate), from the first
	// statement found late to the end of the pass; a failed renewal lets
	// them go, to fail or succeed on their own.
	defer c.behind.open()
	isLate := false
	defer func() {
		if err == nil {
			c.lateness.pass(c.log, isLate, leases, c.cfg.RenewInterval)
		}
	}()
	slack := c.cfg.window().lateSlack()
	var chunks [][]*Lease
	for len(batch) > 0 {
		n := min(len(batch), renewChunk)
		chunks, batch = append(chunks, batch[:n]), batch[n:]
	}
	firsts := make([]time.Time, len(chunks))
	for i, ch := range chunks {
		firsts[i] = until[ch[0]]
	}
	lanes := []fence.DB{q}
	if len(chunks) > 1 && q2 != nil {
		lanes = append(lanes, q2)
	}
	// The lanes take the statements in order, each on its own connection:
	// with two, a statement is sent while the other lane's is at the
	// server (the server renews on two cores, and neither waits for the
	// client to read the other's rows).
	var (
		mu    sync.Mutex
		next  int
		took  = pace
		first error
		wg    sync.WaitGroup
	)
	for _, lq := range lanes {
		wg.Add(1)
		go func() { // owned here: renew waits for its lanes
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				if i == len(chunks) || first != nil {
					mu.Unlock()
					return
				}
				next++
				if late(firsts[i:], c.clock.Now(), took/time.Duration(len(lanes)), slack) {
					isLate = true
					c.behind.shut()
				}
				mu.Unlock()
				sent := time.Now()
				m, err := c.renewStatement(ctx, lq, chunks[i])
				d := time.Since(sent)
				mu.Lock()
				missed = append(missed, m...)
				if err != nil && first == nil {
					first = err
				}
				took, slowest = max(d, took), max(d, slowest)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return slowest, first
}

// late reports whether a renewal pass is late: whether one of its
// statements still to send (firsts: each one's earliest trust deadline, in
// the order they are sent), sent one after another and each taking took,
// would come back with less than slack of that trust left
// (window.lateSlack). A client holding many leases falls behind when its
// server cannot renew them and take new ones at once: the acquisitions
// take the server's time from the renewals.
func late(firsts []time.Time, now time.Time, took, slack time.Duration) bool {
	for i, until := range firsts {
		back := now.Add(time.Duration(i+1) * took)
		if until.Sub(back) < slack {
			return true
		}
	}
	return false
}

// lateness logs when renewal passes become late, and when they have been
// on time again for onTimeAgain passes in a row (so that a client at the
// edge, late and on time by turns, logs once, not at every pass). Only the
// renewer uses it.
type lateness struct {
	late   bool
	onTime int
}

// onTimeAgain is how many on-time passes in a row end a late period.
const onTimeAgain = 3

func (t *lateness) pass(log *slog.Logger, late bool, leases int, renewInterval time.Duration) {
	switch {
	case late && !t.late:
		t.late = true
		log.Warn("pgfence: renewals are late; acquisitions wait for them to catch up. If this lasts, the client holds "+
			"more leases than its server renews in time: hold fewer on this client, give it a longer TTL, or relieve the server",
			"leases", leases, "renew_interval", renewInterval)
	case late:
		t.onTime = 0
	case t.late:
		t.onTime++
		if t.onTime == onTimeAgain {
			t.late, t.onTime = false, 0
			log.Info("pgfence: renewals on time again; acquisitions no longer wait", "leases", leases)
		}
	}
}

// gate holds acquisitions back while the renewals are late, so that a
// client taking many leases does not lose the ones it has (100,000 at a
// 3 s TTL on a 2-core server lost up to 44% of them while 8 goroutines
// acquired more: BENCHMARKS.md). The renewer shuts it and opens it; an
// acquisition passes it before each attempt. Its zero value is open.
type gate struct {
	mu     sync.Mutex
	closed chan struct{} // non-nil while shut; closed when it opens
	waits  atomic.Uint64 // acquisitions that found it shut
}

// shut makes acquisitions wait until open.
func (g *gate) shut() {
	g.mu.Lock()
	if g.closed == nil {
		g.closed = make(chan struct{})
	}
	g.mu.Unlock()
}

// open lets the acquisitions waiting at g go.
func (g *gate) open() {
	g.mu.Lock()
	if g.closed != nil {
		close(g.closed)
		g.closed = nil
	}
	g.mu.Unlock()
}

// pass waits until g is open or ctx ends, and reports whether it waited.
func (g *gate) pass(ctx context.Context) (waited bool, err error) {
	g.mu.Lock()
	ch := g.closed
	g.mu.Unlock()
	if ch == nil {
		return false, nil
	}
	g.waits.Add(1)
	select {
	case <-ch:
		return true, nil
	case <-ctx.Done():
		return true, ctx.Err()
	}
}

// renewStatement renews batch in one statement on q, and returns the
// leases the database did not renew.
func (c *Client) renewStatement(ctx context.Context, q fence.DB, batch []*Lease) ([]*Lease, error) {
	names := make([]string, len(batch))
	tokens := make([]int64, len(batch))
	secrets := make([][]byte, len(batch))
	for i, l := range batch {
		names[i], tokens[i], secrets[i] = l.name, int64(l.token), l.secret
	}
	// The renewal may take until the last of the batch's trust deadlines
	// (past it, every lease has ended on its own timer), not just
	// RenewInterval: after a failover it has to connect again, and a host
	// that does not answer costs up to connect_timeout.
	budget := c.cfg.RenewInterval
	for _, l := range batch {
		budget = max(budget, l.TrustedUntil().Sub(c.clock.Now()))
	}
	ctx, cancel := context.WithTimeout(ctx, budget) // Close cancels it: the leases are released by then
	defer cancel()
	sent := c.clock.Now() // the trust window counts from here
	got, err := c.renewRows(ctx, q, names, tokens, secrets)
	if err != nil {
		return nil, err
	}
	var missed []*Lease
	for _, l := range batch {
		if exp, ok := got[renewKey{l.name, l.token}]; ok {
			l.renewed(sent, exp)
		} else {
			missed = append(missed, l)
		}
	}
	return missed, nil
}

// whyNotRenewed reads the row of a lease the database did not renew, to
// tell why it is lost: taken over, freed, or expired.
func (c *Client) whyNotRenewed(ctx context.Context, q fence.DB, l *Lease) (LossCause, error) {
	var (
		token     int64
		ours      bool
		live      bool
		expiresAt time.Time
	)
	rows, err := q.Query(ctx, c.q.check, l.name, l.secret)
	if err == nil {
		_, err = pgx.ForEachRow(rows, []any{&token, &ours, &live, &expiresAt}, func() error { return nil })
	}
	if err == nil && token != 0 {
		if cause, err := l.judge(token, ours, live, expiresAt); err != nil {
			return cause, err
		}
	}
	return CauseRenewFailed, fmt.Errorf("%w: %q (token %d): %w", ErrLeaseLost, l.name, l.token, errNotRenewed)
}

// renewRows runs the renewal statement for the given acquisitions on q and
// returns the new expiry of each one the database renewed.
func (c *Client) renewRows(ctx context.Context, q fence.DB, names []string, tokens []int64, secrets [][]byte) (map[renewKey]time.Time, error) {
	sent := time.Now()
	rows, err := q.Query(ctx, c.q.renew, names, tokens, secrets, c.cfg.TTL.Microseconds())
	if err != nil {
		return nil, err
	}
	got := make(map[renewKey]time.Time, len(names))
	var lastExp time.Time
	for rows.Next() {
		var (
			k   renewKey
			tok int64
			exp time.Time
		)
		if err := rows.Scan(&k.name, &tok, &exp); err != nil {
			rows.Close()
			return nil, err
		}
		k.token = fence.Token(tok)
		got[k] = exp
		lastExp = exp
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(got) > 0 {
		// expires_at = the statement's now() + TTL, the same for every row.
		rtt := c.stats.observe(sent, time.Now(), lastExp.Add(-c.cfg.TTL))
		c.m.renewTime.Record(ctx, rtt.Seconds())
		c.watchSkew()
	}
	return got, nil
}

// slowRenewal is the fraction of RenewInterval past which a renewal's round
// trip is slow: beyond it, a renewal that slows a little more (the server
// busier, more leases) leaves less than the SafetyMargin between the
// leases' renewals and the end of their trust windows.
const slowRenewal = 0.5

// watchRenewLatency counts a renewal of leases leases that took took, and
// logs once when renewals become slow (past slowRenewal of RenewInterval)
// and once when they are fast again.
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
			"at their trust deadlines: hold fewer leases on this client, give it a longer TTL, or relieve the server",
			"latency", took, "renew_interval", c.cfg.RenewInterval, "leases", leases)
	} else {
		c.log.Info("pgfence: renewals fast again", "latency", took, "leases", leases)
	}
}

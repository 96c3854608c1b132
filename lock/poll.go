package lock

import (
	"context"
	"sync"
	"time"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/retry"
)

// poller watches every lease the client's blocked Acquires wait for, with
// one statement per PollInterval whatever their number: it asks each held
// lease's release to NOTIFY (waiters_until), and wakes the waiters of the
// free or expired ones. Its goroutine runs while anyone waits.
type poller struct {
	c   *Client
	run *bg.Demand

	mu      sync.Mutex
	waiters map[string]map[*waiter]struct{}
	stopped bool
	kick    chan struct{} // cap 1: a waiter arrived, poll now
}

// waiter is one blocked Acquire's registration.
type waiter struct {
	// C receives a value when the lease may be free, and once after the
	// first poll that covered it (the release will then NOTIFY).
	C     chan struct{}
	name  string
	fresh bool
}

func newPoller(c *Client) *poller {
	p := &poller{c: c, waiters: make(map[string]map[*waiter]struct{}), kick: make(chan struct{}, 1)}
	p.run = c.bg.Demand(p.loop, 0, clock.Real())
	return p
}

// add registers a waiter for name and makes the poller cover it at once.
func (p *poller) add(name string) *waiter {
	w := &waiter{C: make(chan struct{}, 1), name: name, fresh: true}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		w.C <- struct{}{} // try again: the attempt reports ErrClosed
		return w
	}
	if p.waiters[name] == nil {
		p.waiters[name] = make(map[*waiter]struct{})
	}
	p.waiters[name][w] = struct{}{}
	select {
	case p.kick <- struct{}{}:
	default:
	}
	p.run.Want()
	return w
}

// remove unregisters w.
func (p *poller) remove(w *waiter) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.waiters[w.name], w)
	if len(p.waiters[w.name]) == 0 {
		delete(p.waiters, w.name)
	}
	if len(p.waiters) == 0 {
		p.run.Idle()
	}
}

// close refuses new waiters and wakes every waiter, whose next attempt
// reports ErrClosed.
func (p *poller) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped {
		return
	}
	p.stopped = true
	for _, ws := range p.waiters {
		for w := range ws {
			wake(w)
		}
	}
}

func wake(w *waiter) {
	select {
	case w.C <- struct{}{}:
	default:
	}
}

// loop polls once per interval (sooner when kicked) until ctx ends; the
// real clock paces it: it decides nothing.
func (p *poller) loop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var failing retry.Failing
	log := p.c.log
	for ctx.Err() == nil {
		p.mu.Lock()
		names := make([]string, 0, len(p.waiters))
		var fresh []*waiter
		for name, ws := range p.waiters {
			names = append(names, name)
			for w := range ws {
				if w.fresh {
					w.fresh = false
					fresh = append(fresh, w)
				}
			}
		}
		p.mu.Unlock()

		var (
			next = time.Hour // nobody waits: until a waiter kicks
			free []string
			err  error
		)
		if len(names) > 0 {
			// On the group's context (an idle end waits for the
			// statement), bounded by a TTL (a black-holed connection).
			pctx, cancel := context.WithTimeout(p.c.bg.Context(), p.c.cfg.TTL)
			next, free, err = p.poll(pctx, names)
			cancel()
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			failing.Fail(log, "pgfence: polling for released leases failing; waiters still wake on release", err)
			next = p.c.backoff.Wait(failing.Count() - 1)
		} else {
			failing.Recover(log, "pgfence: polling for released leases recovered")
		}
		p.mu.Lock()
		for _, w := range fresh {
			wake(w)
		}
		for _, name := range free {
			for w := range p.waiters[name] {
				wake(w)
			}
		}
		p.mu.Unlock()

		timer.Reset(next)
		select {
		case <-timer.C:
		case <-p.kick:
			if !timer.Stop() {
				<-timer.C
			}
		case <-ctx.Done():
		}
	}
}

// poll runs the statement, and returns the free leases among names and
// when to poll next (at the latest, just after the soonest expiry).
func (p *poller) poll(ctx context.Context, names []string) (time.Duration, []string, error) {
	iv := p.c.cfg.PollInterval
	next := retry.Spread(iv)
	rows, err := p.c.pool.Query(ctx, p.c.q.pollWaited, names, (4 * iv).Microseconds(), (2 * iv).Microseconds())
	if err != nil {
		return next, nil, err
	}
	defer rows.Close()
	var free []string
	for rows.Next() {
		var (
			name      string
			isFree    bool
			expiresIn int64
		)
		if err := rows.Scan(&name, &isFree, &expiresIn); err != nil {
			return next, nil, err
		}
		if isFree {
			free = append(free, name)
		} else if d := time.Duration(expiresIn)*time.Microsecond + time.Millisecond; d < next {
			next = d
		}
	}
	return next, free, rows.Err()
}

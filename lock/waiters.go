package lock

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
)

// listenerLinger is how long the listening connection stays open after
// the last waiter has gone, so a wait does not cost a connect.
const listenerLinger = 30 * time.Second

// waiters are a client's blocked Acquires, Watches and Observes, by lease
// name. Two loops wake them, each a Demand of the client's group that runs
// while it has waiters (paced by the real clock: they decide nothing):
//   - the listener holds the LISTEN connection (and listenerLinger after)
//     and wakes a lease's waiters when its release is announced;
//   - the poller watches the leases of the waiters that ask for it (the
//     Acquires) with one statement per PollInterval whatever their number:
//     it asks each held lease's release to NOTIFY (waiters_until), and
//     wakes the waiters of the free or expired ones.
type waiters struct {
	c            *Client
	listen, poll *bg.Demand

	mu      sync.Mutex
	by      map[string]map[*waiter]struct{}
	polled  int           // waiters the poller covers
	ready   chan struct{} // closed once LISTEN is in place; nil when no listener is meant to run
	stopped bool          // the client is closing: no new polled waiters
	kick    chan struct{} // cap 1: a waiter asked to be polled for
}

// waiter is one registration.
type waiter struct {
	// C receives a value when the lease may have been freed.
	C      chan struct{}
	ready  <-chan struct{} // closed once the listener listens
	name   string
	polled bool // the poller covers it
	fresh  bool // no poll has covered it yet
	ws     *waiters
}

func newWaiters(c *Client) *waiters {
	ws := &waiters{c: c, by: make(map[string]map[*waiter]struct{}), kick: make(chan struct{}, 1)}
	ws.listen = c.bg.Demand(ws.listenLoop, listenerLinger, clock.Real())
	ws.poll = c.bg.Demand(ws.pollLoop, 0, clock.Real())
	return ws
}

// subscribe registers a waiter for the releases of name.
func (ws *waiters) subscribe(name string) *waiter {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	w := &waiter{C: make(chan struct{}, 1), name: name, ws: ws}
	if ws.by[name] == nil {
		ws.by[name] = make(map[*waiter]struct{})
	}
	ws.by[name][w] = struct{}{}
	if ws.ready == nil {
		ws.ready = make(chan struct{}) // the next listener closes it
	}
	w.ready = ws.ready
	if !ws.listen.Want() {
		w.ready = make(chan struct{}) // closed client: never ready
	}
	return w
}

// pollFor makes the poller cover w at once; once the client is closing, w
// is woken instead (its next attempt reports ErrClosed).
func (w *waiter) pollFor() {
	ws := w.ws
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.stopped {
		signal(w)
		return
	}
	if !w.polled {
		w.polled, w.fresh = true, true
		ws.polled++
	}
	select {
	case ws.kick <- struct{}{}:
	default:
	}
	ws.poll.Want()
}

// cancel unregisters w.
func (w *waiter) cancel() {
	ws := w.ws
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if _, ok := ws.by[w.name][w]; !ok {
		return
	}
	delete(ws.by[w.name], w)
	if len(ws.by[w.name]) == 0 {
		delete(ws.by, w.name)
	}
	if w.polled {
		if ws.polled--; ws.polled == 0 {
			ws.poll.Idle()
		}
	}
	if len(ws.by) == 0 {
		ws.listen.Idle()
	}
}

// close refuses new polled waiters and wakes those it covers, whose next
// attempt reports ErrClosed.
func (ws *waiters) close() {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	ws.stopped = true
	ws.wakeLocked("", true)
}

// wake wakes the waiters of name, or of every lease when name is "".
func (ws *waiters) wake(name string) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	ws.wakeLocked(name, false)
}

func (ws *waiters) wakeLocked(name string, polledOnly bool) {
	for n, set := range ws.by {
		if name != "" && n != name {
			continue
		}
		for w := range set {
			if w.polled || !polledOnly {
				signal(w)
			}
		}
	}
}

func signal(w *waiter) {
	select {
	case w.C <- struct{}{}:
	default:
	}
}

// listenLoop keeps a LISTEN connection open until ctx ends, reconnecting
// with backoff.
func (ws *waiters) listenLoop(ctx context.Context) {
	ws.mu.Lock()
	if ws.ready == nil {
		ws.ready = make(chan struct{})
	}
	ready := ws.ready
	ws.mu.Unlock()
	readyOnce := sync.OnceFunc(func() { close(ready) })
	defer func() {
		readyOnce() // waiters never hang on ready, even if LISTEN failed
		ws.mu.Lock()
		if ws.ready == ready {
			ws.ready = nil // the next listener has a ready of its own
		}
		ws.mu.Unlock()
	}()
	backoff := retry.Backoff{Base: 50 * time.Millisecond, Max: ws.c.cfg.PollInterval}
	var failing retry.Failing
	for ctx.Err() == nil {
		err := ws.listenOnce(ctx, func() {
			readyOnce()
			failing.Recover(ws.c.log, "pgfence: release listener listening again")
		})
		if ctx.Err() != nil {
			return
		}
		failing.Fail(ws.c.log, "pgfence: release listener failed, reconnecting; waiters poll meanwhile", err)
		if !wait.Sleep(ctx, backoff.Wait(failing.Count()-1)) {
			return
		}
	}
}

// listenOnce listens on a connection hijacked from the pool (it never goes
// back with LISTEN active) until it fails.
func (ws *waiters) listenOnce(ctx context.Context, onReady func()) error {
	ttl := ws.c.cfg.TTL // bounds every wait: a black-holed server answers nothing
	sctx, cancel := context.WithTimeout(ctx, ttl)
	defer cancel()
	pc, err := ws.c.pool.Acquire(sctx)
	if err != nil {
		return err
	}
	conn := pc.Hijack()
	defer conn.Close(context.Background())
	if _, err := conn.Exec(sctx, listenSQL); err != nil {
		return err
	}
	cancel()
	onReady()
	ws.wake("") // a release may have come while the connection was down
	for {
		// After a TTL without a notification, a ping must come back
		// within a TTL, or the connection is opened anew.
		wctx, cancel := context.WithTimeout(ctx, ttl)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		if err != nil && ctx.Err() == nil && wctx.Err() != nil {
			pctx, cancel := context.WithTimeout(ctx, ttl)
			err = conn.Ping(pctx)
			cancel()
			if err != nil {
				return fmt.Errorf("the listening connection did not answer a ping within %v: %w", ttl, err)
			}
			continue
		}
		if err != nil {
			return err
		}
		var p struct {
			Schema string `json:"schema"`
			Name   string `json:"name"`
		}
		if json.Unmarshal([]byte(n.Payload), &p) == nil && p.Schema == ws.c.cfg.Schema {
			ws.wake(p.Name)
		}
	}
}

// pollLoop polls once per interval (sooner when kicked) until ctx ends.
func (ws *waiters) pollLoop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var failing retry.Failing
	for ctx.Err() == nil {
		ws.mu.Lock()
		var (
			names []string
			fresh []*waiter
		)
		for name, set := range ws.by {
			covered := false
			for w := range set {
				if w.polled {
					covered = true
					if w.fresh {
						w.fresh = false
						fresh = append(fresh, w)
					}
				}
			}
			if covered {
				names = append(names, name)
			}
		}
		ws.mu.Unlock()

		var (
			next = time.Hour // nobody waits: until a waiter kicks
			free []string
			err  error
		)
		if len(names) > 0 {
			// On the group's context (an idle end waits for the
			// statement), bounded by a TTL (a black-holed connection).
			pctx, cancel := context.WithTimeout(ws.c.bg.Context(), ws.c.cfg.TTL)
			next, free, err = ws.pollOnce(pctx, names)
			cancel()
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			failing.Fail(ws.c.log, "pgfence: polling for released leases failing; waiters still wake on release", err)
			next = ws.c.backoff.Wait(failing.Count() - 1)
		} else {
			failing.Recover(ws.c.log, "pgfence: polling for released leases recovered")
		}
		ws.mu.Lock()
		for _, w := range fresh {
			signal(w)
		}
		for _, name := range free {
			for w := range ws.by[name] {
				if w.polled {
					signal(w)
				}
			}
		}
		ws.mu.Unlock()

		timer.Reset(next)
		select {
		case <-timer.C:
		case <-ws.kick:
			if !timer.Stop() {
				<-timer.C
			}
		case <-ctx.Done():
		}
	}
}

// pollOnce runs the poll statement, and returns the free leases among
// names and when to poll next (at the latest, just after the soonest
// expiry).
func (ws *waiters) pollOnce(ctx context.Context, names []string) (time.Duration, []string, error) {
	iv := ws.c.cfg.PollInterval
	next := retry.Spread(iv)
	rows, err := ws.c.pool.Query(ctx, ws.c.q.pollWaited, names, (4 * iv).Microseconds(), (2 * iv).Microseconds())
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

// Watch returns a channel that receives a value whenever a release of the
// lease name is announced (Release, ForceRelease, or a statement calling
// the schema's pgfence_wake_waiters(name)), and a function that stops
// watching, on the client's one listening connection. Announcements are
// merged while one is pending, and may be missed while the connection is
// re-established (every watcher is woken once then): react sooner with
// it, but do not rely on it alone.
func (c *Client) Watch(name string) (<-chan struct{}, func()) {
	w := c.waits.subscribe(name)
	return w.C, w.cancel
}

package lock

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/notify"
	"github.com/pgfence/pgfence/internal/retry"
)

// listenerLinger is how long the listening connection stays open after
// the last waiter has gone, so a wait does not cost a connect.
const listenerLinger = 30 * time.Second

// waiters are a client's blocked Acquires, Watches and Observes, by lease
// name. Two loops wake them, each a Demand of the client's group that runs
// while it has waiters (paced by the real clock: they decide nothing):
//   - the listener (package notify) holds the LISTEN connection (and
//     listenerLinger after) and wakes a lease's waiters when its release is
//     announced;
//   - the poller watches the leases of the waiters that ask for it (the
//     Acquires) with one statement per PollInterval whatever their number:
//     it asks each held lease's release to NOTIFY (waiters_until), and
//     wakes the waiters of the free or expired ones.
type waiters struct {
	c      *Client
	listen *notify.Hub
	poll   *bg.Demand

	mu      sync.Mutex
	polled  map[*waiter]bool // the waiters the poller covers: true until a poll covers it
	stopped bool             // the client is closing: no new polled waiters
	kick    chan struct{}    // cap 1: a waiter asked to be polled for
}

// waiter is one registration.
type waiter struct {
	*notify.Sub
	ws *waiters
}

func newWaiters(c *Client) *waiters {
	ws := &waiters{c: c, polled: make(map[*waiter]bool), kick: make(chan struct{}, 1)}
	ws.listen = notify.New(c.bg, c.pool, notify.Config{
		Listen: listenSQL,
		Key: func(payload string) (string, bool) {
			var p struct {
				Schema string `json:"schema"`
				Name   string `json:"name"`
			}
			return p.Name, json.Unmarshal([]byte(payload), &p) == nil && p.Schema == c.cfg.Schema
		},
		Bound:      c.cfg.TTL,
		Linger:     listenerLinger,
		MaxBackoff: c.cfg.PollInterval,
		Log:        c.log,
		Failed:     "pgfence: release listener failed, reconnecting; waiters poll meanwhile",
		Recovered:  "pgfence: release listener listening again",
	})
	ws.poll = c.bg.Demand(ws.pollLoop, 0, clock.Real())
	return ws
}

// subscribe registers a waiter for the releases of name.
func (ws *waiters) subscribe(name string) *waiter {
	return &waiter{Sub: ws.listen.Subscribe(name), ws: ws}
}

// pollFor makes the poller cover w at once; once the client is closing, w
// is woken instead (its next attempt reports ErrClosed).
func (w *waiter) pollFor() {
	ws := w.ws
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.stopped {
		w.Signal()
		return
	}
	if _, ok := ws.polled[w]; !ok {
		ws.polled[w] = true
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
	if _, ok := ws.polled[w]; ok {
		delete(ws.polled, w)
		if len(ws.polled) == 0 {
			ws.poll.Idle()
		}
	}
	ws.mu.Unlock()
	w.Cancel()
}

// close refuses new polled waiters and wakes those it covers, whose next
// attempt reports ErrClosed.
func (ws *waiters) close() {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	ws.stopped = true
	for w := range ws.polled {
		w.Signal()
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
			seen  = make(map[string]bool)
		)
		for w, isFresh := range ws.polled {
			if isFresh {
				ws.polled[w] = false
				fresh = append(fresh, w)
			}
			if !seen[w.Key()] {
				seen[w.Key()] = true
				names = append(names, w.Key())
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
		for _, w := range fresh {
			w.Signal()
		}
		if len(free) > 0 {
			isFree := make(map[string]bool, len(free))
			for _, name := range free {
				isFree[name] = true
			}
			ws.mu.Lock()
			for w := range ws.polled {
				if isFree[w.Key()] {
					w.Signal()
				}
			}
			ws.mu.Unlock()
		}

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

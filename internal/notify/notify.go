// Package notify wakes a lock client's waiters, each waiting on a lease
// name (its key), by two means, each a goroutine of the client's group that
// runs only while needed:
//   - a connection listening on pgfence_released, held while anyone
//     subscribes (and a linger after), wakes the subscriptions of the lease
//     each release notification names (pgfence_wake_waiters sends
//     {"schema", "name"}; other schemas' are ignored).
//     Notifications are merged while one is pending, and may be missed
//     while the connection is re-established: every subscription is woken
//     once then, so a subscriber re-reads the state it waits on, and must
//     not rely on notifications alone;
//   - a poller, while a subscription asks for it (Sub.Poll), reads the
//     state of all their keys in one call per round, and wakes those of
//     the keys that are ready (and each new one after its first round).
package notify

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
)

// listenSQL subscribes to the releases' notifications.
const listenSQL = "LISTEN pgfence_released"

// Config says how a Hub listens and polls.
type Config struct {
	// Schema is the schema whose release notifications wake subscriptions.
	Schema string
	// Bound bounds every wait: the connect and LISTEN, and the ping sent
	// after Bound without a notification, which must come back within
	// Bound or the connection is opened anew (a black-holed server answers
	// nothing).
	Bound time.Duration
	// Linger is how long the connection stays open after the last
	// subscription has gone, so that the next one does not cost a connect.
	Linger time.Duration
	// MaxBackoff caps the wait between reconnects.
	MaxBackoff time.Duration
	// Poll reads the keys of the subscriptions that asked (one call for
	// all), and returns those that are ready and when to poll next. It
	// runs on the group's context bounded by Bound; a failure is retried
	// after Backoff.
	Poll    func(ctx context.Context, keys []string) (ready []string, next time.Duration, err error)
	Backoff retry.Backoff
	// Log hears each start and end of a failure period: the listener's as
	// Failed and Recovered, the poller's as PollFailed and PollRecovered.
	Log                                          *slog.Logger
	Failed, Recovered, PollFailed, PollRecovered string
}

// Hub holds a client's subscriptions, its listening connection and its
// poller, which the client's group runs.
type Hub struct {
	cfg          Config
	pool         *pgxpool.Pool
	g            *bg.Group
	listen, poll *bg.Demand

	mu      sync.Mutex
	by      map[string]map[*Sub]struct{}
	ready   chan struct{} // closed once LISTEN is in place; nil when no listener is meant to run
	polled  map[*Sub]bool // the subscriptions the poller covers: true until a round covers it
	stopped bool          // Close has begun: no new polled subscriptions
	kick    chan struct{} // cap 1: a subscription asked to be polled for
}

// Sub is one subscription.
type Sub struct {
	// C receives a value when its key's release may have come: a
	// notification, a poll that found it ready, a reconnect, Close.
	C chan struct{}
	// Ready is closed once the connection listens, or once the listener
	// that was to listen has ended (idled or stopped); never if the group
	// had stopped.
	Ready <-chan struct{}
	key   string
	h     *Hub
}

// New returns a Hub on pool whose listener and poller g runs.
func New(g *bg.Group, pool *pgxpool.Pool, cfg Config) *Hub {
	h := &Hub{cfg: cfg, pool: pool, g: g, by: make(map[string]map[*Sub]struct{}), polled: make(map[*Sub]bool),
		kick: make(chan struct{}, 1)}
	// Paced by the real clock: they decide nothing.
	h.listen = g.Demand(h.loop, cfg.Linger, clock.Real())
	h.poll = g.Demand(h.pollLoop, 0, clock.Real())
	return h
}

// Subscribe registers a subscription to the notifications of key.
func (h *Hub) Subscribe(key string) *Sub {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := &Sub{C: make(chan struct{}, 1), key: key, h: h}
	if h.by[key] == nil {
		h.by[key] = make(map[*Sub]struct{})
	}
	h.by[key][s] = struct{}{}
	if h.ready == nil {
		h.ready = make(chan struct{}) // the next listener closes it
	}
	s.Ready = h.ready
	if !h.listen.Want() {
		s.Ready = make(chan struct{}) // the group has stopped: never ready
	}
	return s
}

// Cancel unregisters s; the connection closes after the linger once no
// subscription is left.
func (s *Sub) Cancel() {
	h := s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.by[s.key][s]; !ok {
		return
	}
	delete(h.by[s.key], s)
	if len(h.by[s.key]) == 0 {
		delete(h.by, s.key)
	}
	if len(h.by) == 0 {
		h.listen.Idle()
	}
	if _, ok := h.polled[s]; ok {
		delete(h.polled, s)
		if len(h.polled) == 0 {
			h.poll.Idle()
		}
	}
}

// Poll makes the poller cover s at once (until Cancel); once Close has
// begun, s is woken instead.
func (s *Sub) Poll() {
	h := s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.by[s.key][s]; !ok {
		return // cancelled
	}
	if h.stopped {
		s.Signal()
		return
	}
	if _, ok := h.polled[s]; !ok {
		h.polled[s] = true
	}
	select {
	case h.kick <- struct{}{}:
	default:
	}
	h.poll.Want()
}

// Close refuses new polled subscriptions and wakes those the poller
// covers: their owner is closing.
func (h *Hub) Close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stopped = true
	for s := range h.polled {
		s.Signal()
	}
}

// Signal wakes s, unless a wake is pending.
func (s *Sub) Signal() {
	select {
	case s.C <- struct{}{}:
	default:
	}
}

// wake wakes the subscriptions of key, or all when key is "".
func (h *Hub) wake(key string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for k, set := range h.by {
		if key == "" || k == key {
			for s := range set {
				s.Signal()
			}
		}
	}
}

// loop keeps a LISTEN connection open until ctx ends, reconnecting with
// backoff.
func (h *Hub) loop(ctx context.Context) {
	h.mu.Lock()
	if h.ready == nil {
		h.ready = make(chan struct{})
	}
	ready := h.ready
	h.mu.Unlock()
	readyOnce := sync.OnceFunc(func() { close(ready) })
	defer func() {
		readyOnce() // subscribers never hang on Ready, even if LISTEN failed
		h.mu.Lock()
		if h.ready == ready {
			h.ready = nil // the next listener has a ready of its own
		}
		h.mu.Unlock()
	}()
	backoff := retry.Backoff{Base: 50 * time.Millisecond, Max: h.cfg.MaxBackoff}
	var failing retry.Failing
	for ctx.Err() == nil {
		err := h.once(ctx, func() {
			readyOnce()
			failing.Recover(h.cfg.Log, h.cfg.Recovered)
		})
		if ctx.Err() != nil {
			return
		}
		failing.Fail(h.cfg.Log, h.cfg.Failed, err)
		if !wait.Sleep(ctx, backoff.Wait(failing.Count()-1)) {
			return
		}
	}
}

// once listens on a connection hijacked from the pool (it never goes back
// with LISTEN active) until it fails.
func (h *Hub) once(ctx context.Context, onReady func()) error {
	bound := h.cfg.Bound
	sctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	pc, err := h.pool.Acquire(sctx)
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
	h.wake("") // a notification may have come while the connection was down
	for {
		wctx, cancel := context.WithTimeout(ctx, bound)
		n, err := conn.WaitForNotification(wctx)
		cancel()
		if err != nil && ctx.Err() == nil && wctx.Err() != nil {
			pctx, cancel := context.WithTimeout(ctx, bound)
			err = conn.Ping(pctx)
			cancel()
			if err != nil {
				return fmt.Errorf("the listening connection did not answer a ping within %v: %w", bound, err)
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
		if json.Unmarshal([]byte(n.Payload), &p) == nil && p.Schema == h.cfg.Schema && p.Name != "" {
			h.wake(p.Name)
		}
	}
}

// pollLoop polls once per round (sooner when kicked) until ctx ends.
func (h *Hub) pollLoop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var failing retry.Failing
	for ctx.Err() == nil {
		h.mu.Lock()
		var (
			keys  []string
			fresh []*Sub
			seen  = make(map[string]bool)
		)
		for s, isFresh := range h.polled {
			if isFresh {
				h.polled[s] = false
				fresh = append(fresh, s)
			}
			if !seen[s.key] {
				seen[s.key] = true
				keys = append(keys, s.key)
			}
		}
		h.mu.Unlock()

		var (
			next  = time.Hour // nobody waits: until a subscription kicks
			ready []string
			err   error
		)
		if len(keys) > 0 {
			// On the group's context (an owner's work may wait for the
			// statement), bounded (a black-holed connection).
			pctx, cancel := context.WithTimeout(h.g.Context(), h.cfg.Bound)
			ready, next, err = h.cfg.Poll(pctx, keys)
			cancel()
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			failing.Fail(h.cfg.Log, h.cfg.PollFailed, err)
			next = h.cfg.Backoff.Wait(failing.Count() - 1)
		} else {
			failing.Recover(h.cfg.Log, h.cfg.PollRecovered)
		}
		for _, s := range fresh {
			s.Signal()
		}
		if len(ready) > 0 {
			isReady := make(map[string]bool, len(ready))
			for _, key := range ready {
				isReady[key] = true
			}
			h.mu.Lock()
			for s := range h.polled {
				if isReady[s.key] {
					s.Signal()
				}
			}
			h.mu.Unlock()
		}

		timer.Reset(next)
		select {
		case <-timer.C:
		case <-h.kick:
			if !timer.Stop() {
				<-timer.C
			}
		case <-ctx.Done():
		}
	}
}

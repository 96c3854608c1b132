// Package notify holds one LISTEN connection for its owner while anyone
// subscribes (and a linger after), and wakes the subscriptions of the key
// each notification names. Notifications are merged while one is pending,
// and may be missed while the connection is re-established: every
// subscription is woken once then, so a subscriber re-reads the state it
// waits on, and must not rely on notifications alone.
package notify

import (
	"context"
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

// Config says what a Hub listens to and how.
type Config struct {
	// Listen is the LISTEN statement.
	Listen string
	// Key names the key a notification's payload is for (false: ignore it).
	Key func(payload string) (string, bool)
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
	// Log hears each start and end of a failure period, as Failed and
	// Recovered.
	Log               *slog.Logger
	Failed, Recovered string
}

// Hub holds the LISTEN connection of one owner, whose group runs it.
type Hub struct {
	cfg    Config
	pool   *pgxpool.Pool
	listen *bg.Demand

	mu    sync.Mutex
	by    map[string]map[*Sub]struct{}
	ready chan struct{} // closed once LISTEN is in place; nil when no listener is meant to run
}

// Sub is one subscription.
type Sub struct {
	// C receives a value when a notification for its key may have come.
	C chan struct{}
	// Ready is closed once the connection listens (or has failed to; never
	// once the owner's group has stopped).
	Ready <-chan struct{}
	key   string
	h     *Hub
}

// New returns a Hub on pool whose listening goroutine g runs.
func New(g *bg.Group, pool *pgxpool.Pool, cfg Config) *Hub {
	h := &Hub{cfg: cfg, pool: pool, by: make(map[string]map[*Sub]struct{})}
	h.listen = g.Demand(h.loop, cfg.Linger, clock.Real())
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
}

// Key returns the key s subscribes to.
func (s *Sub) Key() string { return s.key }

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
	if _, err := conn.Exec(sctx, h.cfg.Listen); err != nil {
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
		if key, ok := h.cfg.Key(n.Payload); ok {
			h.wake(key)
		}
	}
}

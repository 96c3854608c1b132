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

// listener holds a client's LISTEN connection while anything subscribes
// (and listenerLinger after), and wakes a lease's subscribers when it is
// released.
type listener struct {
	c   *Client
	run *bg.Demand

	mu    sync.Mutex
	subs  map[string]map[*subscription]struct{}
	ready chan struct{} // closed once LISTEN is in place; nil when no goroutine is meant to run
}

type subscription struct {
	// C receives a value when the lease may have been freed.
	C     chan struct{}
	ready <-chan struct{}
	name  string
	l     *listener
}

func newListener(c *Client) *listener {
	li := &listener{c: c, subs: make(map[string]map[*subscription]struct{})}
	li.run = c.bg.Demand(li.loop, listenerLinger, clock.Real())
	return li
}

func (li *listener) subscribe(name string) *subscription {
	li.mu.Lock()
	defer li.mu.Unlock()
	s := &subscription{C: make(chan struct{}, 1), name: name, l: li}
	if li.subs[name] == nil {
		li.subs[name] = make(map[*subscription]struct{})
	}
	li.subs[name][s] = struct{}{}
	if li.ready == nil {
		li.ready = make(chan struct{}) // the next goroutine closes it
	}
	s.ready = li.ready
	if !li.run.Want() {
		// Client closed: never ready, the waiter polls.
		s.ready = make(chan struct{})
	}
	return s
}

func (s *subscription) cancel() {
	li := s.l
	li.mu.Lock()
	defer li.mu.Unlock()
	delete(li.subs[s.name], s)
	if len(li.subs[s.name]) == 0 {
		delete(li.subs, s.name)
	}
	if len(li.subs) == 0 {
		li.run.Idle()
	}
}

// wake notifies the waiters of name, or of every lease when name is "".
func (li *listener) wake(name string) {
	li.mu.Lock()
	defer li.mu.Unlock()
	for n, set := range li.subs {
		if name != "" && n != name {
			continue
		}
		for s := range set {
			select {
			case s.C <- struct{}{}:
			default:
			}
		}
	}
}

// loop keeps a LISTEN connection open until ctx ends, reconnecting with
// backoff, on a connection hijacked from the pool (it never goes back with
// LISTEN active).
func (li *listener) loop(ctx context.Context) {
	li.mu.Lock()
	if li.ready == nil {
		li.ready = make(chan struct{})
	}
	ready := li.ready
	li.mu.Unlock()
	readyOnce := sync.OnceFunc(func() { close(ready) })
	defer func() {
		readyOnce() // waiters never hang on ready, even if LISTEN failed
		li.mu.Lock()
		if li.ready == ready {
			li.ready = nil // the next goroutine has a ready of its own
		}
		li.mu.Unlock()
	}()
	backoff := retry.Backoff{Base: 50 * time.Millisecond, Max: li.c.cfg.PollInterval}
	var failing retry.Failing
	log := li.c.log
	for ctx.Err() == nil {
		err := li.listen(ctx, func() {
			readyOnce()
			failing.Recover(log, "pgfence: release listener listening again")
		})
		if ctx.Err() != nil {
			return
		}
		failing.Fail(log, "pgfence: release listener failed, reconnecting; waiters poll meanwhile", err)
		if !wait.Sleep(ctx, backoff.Wait(failing.Count()-1)) {
			return
		}
	}
}

func (li *listener) listen(ctx context.Context, onReady func()) error {
	ttl := li.c.cfg.TTL // bounds every wait: a black-holed server answers nothing
	sctx, cancel := context.WithTimeout(ctx, ttl)
	defer cancel()
	pc, err := li.c.pool.Acquire(sctx)
	if err != nil {
		return err
	}
	conn := pc.Hijack()
	defer conn.Close(context.Background())
	schema := li.c.cfg.Schema
	if _, err := conn.Exec(sctx, listenSQL); err != nil {
		return err
	}
	cancel()
	onReady()
	// A release may have happened while the connection was down.
	li.wake("")
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
		if json.Unmarshal([]byte(n.Payload), &p) != nil || p.Schema != schema {
			continue
		}
		li.wake(p.Name)
	}
}

// Watch returns a channel that receives a value whenever a release of the
// lease name is announced (Release, ForceRelease, or a statement calling
// the schema's pgfence_wake_waiters(name)), and a function that stops
// watching, on the client's one listening connection. Announcements are
// merged while one is pending, and may be missed while the connection is
// re-established (every watcher is woken once then): react sooner with
// it, but do not rely on it alone.
func (c *Client) Watch(name string) (<-chan struct{}, func()) {
	s := c.lis.subscribe(name)
	return s.C, s.cancel
}

package lock

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
)

// listenerLinger is how long the listening connection stays open after
// the last waiter or watcher has gone: a client that hands leases back and
// forth does not open a server connection for every wait.
const listenerLinger = 30 * time.Second

// listener holds one LISTEN connection per client while any Acquire waits
// (and for listenerLinger after), and wakes the waiters of a lease when it is
// released.
type listener struct {
	c *Client

	mu      sync.Mutex
	subs    map[string]map[*subscription]struct{}
	cancel  context.CancelFunc // stops the running goroutine; nil when idle
	ready   chan struct{}      // closed once LISTEN is in place
	idle    *time.Timer        // stops the goroutine once it has lingered unused
	stopped bool
}

type subscription struct {
	// C receives a value when the lease may have been freed.
	C     chan struct{}
	ready <-chan struct{}
	name  string
	l     *listener
}

func newListener(c *Client) *listener {
	return &listener{c: c, subs: make(map[string]map[*subscription]struct{})}
}

func (li *listener) subscribe(name string) *subscription {
	li.mu.Lock()
	defer li.mu.Unlock()
	s := &subscription{C: make(chan struct{}, 1), name: name, l: li}
	if li.idle != nil {
		li.idle.Stop()
		li.idle = nil
	}
	if li.subs[name] == nil {
		li.subs[name] = make(map[*subscription]struct{})
	}
	li.subs[name][s] = struct{}{}
	if li.cancel == nil && !li.stopped {
		// Its own cancel stops it when idle; the client's group stops it
		// at Close.
		ctx, cancel := context.WithCancel(li.c.bg.Context())
		ready := make(chan struct{})
		if li.c.bg.Go(func(context.Context) { li.run(ctx, ready) }) {
			li.cancel, li.ready = cancel, ready
		} else {
			cancel()
		}
	}
	s.ready = li.ready
	if s.ready == nil { // client closed: never ready, the waiter polls
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
	if len(li.subs) == 0 && li.cancel != nil && li.idle == nil {
		li.idle = time.AfterFunc(listenerLinger, li.stopIfIdle)
	}
}

// stopIfIdle stops the goroutine if nothing has subscribed since it lingered.
func (li *listener) stopIfIdle() {
	li.mu.Lock()
	defer li.mu.Unlock()
	li.idle = nil
	if len(li.subs) == 0 && li.cancel != nil {
		li.cancel()
		li.cancel = nil
	}
}

func (li *listener) stop() {
	li.mu.Lock()
	li.stopped = true
	if li.idle != nil {
		li.idle.Stop()
		li.idle = nil
	}
	if li.cancel != nil {
		li.cancel()
		li.cancel = nil
	}
	li.mu.Unlock()
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

// run keeps a LISTEN connection open until ctx ends, reconnecting with
// capped exponential backoff. It warns once when the connection fails and
// notes once when LISTEN is back, however many reconnects fail in between
// (a failover takes many). The connection is hijacked from the pool so it
// never goes back with LISTEN still active.
func (li *listener) run(ctx context.Context, ready chan struct{}) {
	readyOnce := sync.OnceFunc(func() { close(ready) })
	defer readyOnce() // waiters never hang on ready, even if LISTEN failed
	backoff := retry.Backoff{Base: 50 * time.Millisecond, Max: li.c.cfg.PollInterval}
	var failing retry.Failing
	log := li.c.cfg.Logger
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
	pc, err := li.c.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	conn := pc.Hijack()
	defer conn.Close(context.Background())
	schema := li.c.cfg.Schema
	if _, err := conn.Exec(ctx, listenSQL); err != nil {
		return err
	}
	onReady()
	// A release may have happened while the connection was down.
	li.wake("")
	for {
		n, err := conn.WaitForNotification(ctx)
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
// lease name is announced (by Release, ForceRelease, or a statement calling
// the schema's pgfence_wake_waiters(name)), and a function that stops
// watching. It shares the client's one listening connection with blocked
// acquirers, which stays open while anything watches or waits. Announcements
// are merged while a value is pending, and may be missed while the
// connection is being re-established (every watcher is woken once when it
// is back), so use it to react sooner, not as the only trigger.
func (c *Client) Watch(name string) (<-chan struct{}, func()) {
	s := c.lis.subscribe(name)
	return s.C, s.cancel
}

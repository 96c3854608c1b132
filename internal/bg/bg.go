// Package bg is the one lifecycle of pgfence's background goroutines. A
// Group owns them: each is started with Go or Start and gets the group's
// context (Start's may also be cancelled alone); Stop cancels that context
// and waits until every one has returned. A goroutine that runs only while
// there is work (the lease renewer while leases are held, the poller and
// the listener while anyone waits) is a Demand: its owner says Want or
// Idle, and the Demand starts and ends it. The goroutines themselves are
// plain loops that return when their context ends.
package bg

import (
	"context"
	"sync"
	"time"

	"github.com/pgfence/pgfence/internal/clock"
)

// Group owns a set of background goroutines. The zero value is not usable:
// build one with New.
type Group struct {
	parent context.Context
	ctx    context.Context
	cancel context.CancelCauseFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	stopped bool
	once    sync.Once
}

// New returns a group whose goroutines' context is derived from parent
// (its values, and its cancellation).
func New(parent context.Context) *Group {
	ctx, cancel := context.WithCancelCause(parent)
	return &Group{parent: parent, ctx: ctx, cancel: cancel}
}

// Context is the context the group's goroutines run with: it ends at Stop.
func (g *Group) Context() context.Context { return g.ctx }

// Go runs fn(ctx) in a new goroutine owned by the group and reports true,
// or, once Stop has begun, does not run it and reports false (the caller
// then runs what must still happen itself).
func (g *Group) Go(fn func(ctx context.Context)) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		return false
	}
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		fn(g.ctx)
	}()
	return true
}

// Stop cancels the group's context (with the parent's cause when the
// parent has ended), then waits for every goroutine started with Go to
// return. It runs once; later and concurrent calls wait for the
// first.
func (g *Group) Stop() {
	g.once.Do(func() {
		g.mu.Lock()
		g.stopped = true
		g.mu.Unlock()
		// The parent's cause, if it has ended: Stop may run before the
		// parent's cancellation has reached the group's context.
		g.cancel(context.Cause(g.parent))
		g.wg.Wait()
	})
}

// Start runs fn(ctx) like Go, with a context of its own: calling the
// returned cancel ends that goroutine alone (Stop still waits for it). ok is
// false, and fn does not run, once Stop has begun.
func (g *Group) Start(fn func(ctx context.Context)) (cancel context.CancelFunc, ok bool) {
	ctx, cancel := context.WithCancel(g.ctx)
	if !g.Go(func(context.Context) {
		defer cancel()
		fn(ctx)
	}) {
		cancel()
		return nil, false
	}
	return cancel, true
}

// Demand is a goroutine of a Group that runs while it is wanted: Want starts
// it if it is not running, Idle ends it once it has been unwanted for the
// linger, and a Want meanwhile keeps it. Its function is a plain loop that
// returns when its context ends (a statement that must not be cut when the
// goroutine is idled, since cancelling it closes its connection, runs on
// the group's context instead: Stop still cancels it); when to run is
// decided here, once, under
// Demand's own lock, so that an owner only says whether it has work. At
// most one goroutine of a Demand runs at a time: a Want that arrives while
// the goroutine is ending starts it again once it has returned.
type Demand struct {
	g      *Group
	run    func(ctx context.Context)
	linger time.Duration
	clock  clock.Clock

	mu      sync.Mutex
	wanted  bool
	running bool               // a goroutine runs (it may be ending)
	cancel  context.CancelFunc // ends the running goroutine
	idle    clock.Timer        // pending end after the linger
}

// Demand returns an idle Demand whose goroutine runs fn. The linger, read
// on clk, is how long it keeps running after Idle (0: it is ended at once).
func (g *Group) Demand(fn func(ctx context.Context), linger time.Duration, clk clock.Clock) *Demand {
	return &Demand{g: g, run: fn, linger: linger, clock: clk}
}

// Want starts the goroutine unless it runs, and cancels a pending end. It
// reports whether the goroutine runs or will run again: false once the
// group has stopped.
func (d *Demand) Want() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.wanted = true
	if d.idle != nil {
		d.idle.Stop()
		d.idle = nil
	}
	if !d.running {
		d.startLocked()
	}
	return d.running && d.g.ctx.Err() == nil
}

// Idle ends the goroutine after the linger, unless Want is called first.
func (d *Demand) Idle() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.wanted = false
	if !d.running || d.idle != nil {
		return
	}
	if d.linger <= 0 {
		d.cancel()
		return
	}
	var t clock.Timer
	t = d.clock.AfterFunc(d.linger, func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if d.idle != t {
			return // stopped by a Want, or a later Idle's timer
		}
		d.idle = nil
		if !d.wanted && d.running {
			d.cancel()
		}
	})
	d.idle = t
}

// startLocked starts the goroutine; d.mu is held.
func (d *Demand) startLocked() {
	cancel, ok := d.g.Start(func(ctx context.Context) {
		d.run(ctx)
		d.mu.Lock()
		defer d.mu.Unlock()
		d.running, d.cancel = false, nil
		// Wanted again while it was ending (it was idled: its context
		// ended, not the group's). A function that returned on its own is
		// not run again in a loop.
		if d.wanted && ctx.Err() != nil && d.g.ctx.Err() == nil {
			d.startLocked()
		}
	})
	d.running, d.cancel = ok, cancel
}

// Task is one goroutine whose owner is a function, not a Group: the
// function that starts it with Run stops it, on every path out (Stop:
// cancel, then wait). Done is closed when it has returned, for an owner
// that waits on other things too.
type Task struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// Run runs fn(ctx) in a new goroutine, ctx derived from parent and ended by
// the Task's Stop.
func Run(parent context.Context, fn func(ctx context.Context)) *Task {
	ctx, cancel := context.WithCancel(parent)
	t := &Task{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(t.done)
		defer cancel()
		fn(ctx)
	}()
	return t
}

// RunAfter is Run that starts the goroutine only once d has passed (on the
// real clock: it paces work), so that a Task stopped sooner costs none.
func RunAfter(parent context.Context, d time.Duration, fn func(ctx context.Context)) *Task {
	ctx, cancel := context.WithCancel(parent)
	t := &Task{done: make(chan struct{})}
	timer := time.AfterFunc(d, func() {
		defer close(t.done)
		defer cancel()
		fn(ctx)
	})
	t.cancel = func() {
		cancel()
		if timer.Stop() { // it never started, and now never will
			close(t.done)
		}
	}
	return t
}

// Done is closed once the goroutine has returned.
func (t *Task) Done() <-chan struct{} { return t.done }

// Stop cancels the goroutine's context and waits until it has returned.
// It may be called more than once, and concurrently.
func (t *Task) Stop() {
	t.cancel()
	<-t.done
}

// StopWithin is Stop that waits at most d (on the real clock: it paces a
// shutdown), and reports whether the goroutine returned; if not, it keeps
// ending on its own.
func (t *Task) StopWithin(d time.Duration) bool {
	t.cancel()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-t.done:
		return true
	case <-timer.C:
		return false
	}
}

// Package bg is the one lifecycle of pgfence's background goroutines. A
// Group owns them: each is started with Go (on demand, by its owner) and
// gets the group's context; Stop cancels that context and waits until every
// one has returned. A goroutine may also end on its own when it has nothing
// left to do; its owner decides that under its own lock, as it decides to
// start one.
package bg

import (
	"context"
	"sync"
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

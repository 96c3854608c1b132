package bg

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pgfence/pgfence/internal/clock"
)

// Stop cancels every goroutine's context and returns only when all have
// returned; Go after Stop runs nothing; Stop runs once however often and
// from however many goroutines it is called.
func TestStopCancelsThenWaits(t *testing.T) {
	defer goleak.VerifyNone(t)
	g := New(context.Background())
	var running, returned atomic.Int32
	for range 5 {
		if !g.Go(func(ctx context.Context) {
			running.Add(1)
			<-ctx.Done()
			time.Sleep(10 * time.Millisecond) // cleanup after the cancel
			returned.Add(1)
		}) {
			t.Fatal("Go before Stop did not start the goroutine")
		}
	}
	for running.Load() < 5 {
		time.Sleep(time.Millisecond)
	}
	done := make(chan struct{})
	for range 3 {
		go func() { g.Stop(); done <- struct{}{} }()
	}
	for range 3 {
		<-done
		if n := returned.Load(); n != 5 {
			t.Fatalf("Stop returned with %d of 5 goroutines done", n)
		}
	}
	if g.Go(func(context.Context) { t.Error("ran after Stop") }) {
		t.Fatal("Go after Stop reported true")
	}
	if g.Context().Err() == nil {
		t.Fatal("the group's context is live after Stop")
	}
}

// A goroutine may end on its own before Stop; the group's context follows
// its parent's cancellation.
func TestGoroutinesEndOnTheirOwnAndWithTheParent(t *testing.T) {
	defer goleak.VerifyNone(t)
	parent, cancel := context.WithCancel(context.Background())
	g := New(parent)
	ended := make(chan struct{})
	g.Go(func(context.Context) { close(ended) })
	<-ended
	stopped := make(chan struct{})
	g.Go(func(ctx context.Context) { <-ctx.Done(); close(stopped) })
	cancel()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("the parent's cancellation did not reach the group's goroutines")
	}
	g.Stop()
}

// A group stopped by its owner as soon as the parent's context ends (as
// the balancer stops its workers) keeps the parent's cause: the workers
// tell a shutdown from other cancellations by it. Before, Stop could win
// the race with the parent's own propagation and leave context.Canceled.
func TestStopKeepsTheParentsCause(t *testing.T) {
	shutdown := errors.New("shutdown")
	lost := 0
	for range 20000 {
		parent, cancel := context.WithCancelCause(context.Background())
		g := New(parent)
		stopped := make(chan struct{})
		go func() { <-parent.Done(); g.Stop(); close(stopped) }()
		cancel(shutdown)
		<-stopped
		if !errors.Is(context.Cause(g.Context()), shutdown) {
			lost++
		}
	}
	if lost > 0 {
		t.Fatalf("%d of 20000 groups lost their parent's cause", lost)
	}
}

// A Demand runs one goroutine while wanted, ends it only after the linger
// has passed unwanted, keeps it when wanted again within the linger, and
// starts it again after it ended; Stop ends it and later Wants start
// nothing.
func TestDemandRunsWhileWanted(t *testing.T) {
	defer goleak.VerifyNone(t)
	clk := clock.NewFake(time.Unix(0, 0))
	g := New(context.Background())
	var starts, running atomic.Int32
	ended := make(chan struct{}, 10)
	d := g.Demand(func(ctx context.Context) {
		starts.Add(1)
		if running.Add(1) != 1 {
			t.Error("two goroutines of one Demand ran at once")
		}
		<-ctx.Done()
		running.Add(-1)
		ended <- struct{}{}
	}, time.Minute, clk)

	if !d.Want() || !d.Want() {
		t.Fatal("Want before Stop reported not running")
	}
	waitFor(t, func() bool { return starts.Load() == 1 })
	d.Idle()
	clk.Advance(59 * time.Second)
	d.Want() // within the linger: kept
	clk.Advance(time.Hour)
	select {
	case <-ended:
		t.Fatal("the goroutine ended although wanted again within the linger")
	default:
	}
	d.Idle()
	clk.Advance(time.Minute)
	<-ended // ends once the linger has passed unwanted
	d.Want()
	waitFor(t, func() bool { return starts.Load() == 2 })
	g.Stop()
	<-ended
	if d.Want() {
		t.Fatal("Want after Stop reported running")
	}
	if n := starts.Load(); n != 2 {
		t.Fatalf("%d starts, want 2", n)
	}
}

// A Want that arrives while the goroutine is ending (its context already
// cancelled) starts it again once it has returned, never a second one
// beside it.
func TestDemandWantedWhileEnding(t *testing.T) {
	defer goleak.VerifyNone(t)
	g := New(context.Background())
	defer g.Stop()
	var starts, running atomic.Int32
	release := make(chan struct{})
	d := g.Demand(func(ctx context.Context) {
		n := starts.Add(1)
		if running.Add(1) != 1 {
			t.Error("two goroutines of one Demand ran at once")
		}
		<-ctx.Done()
		if n == 1 {
			<-release // the first one is slow to end
		}
		running.Add(-1)
	}, 0, clock.Real())
	d.Want()
	waitFor(t, func() bool { return starts.Load() == 1 })
	d.Idle() // linger 0: cancelled at once
	d.Want()
	if starts.Load() != 1 {
		t.Fatal("a second goroutine started while the first was ending")
	}
	close(release)
	waitFor(t, func() bool { return starts.Load() == 2 })
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached within 10 s")
		}
		time.Sleep(time.Millisecond)
	}
}

// A Task's Stop cancels its goroutine and returns once it has returned, and
// may be called again; Done is closed when the goroutine returns on its own;
// StopWithin gives up on a goroutine that does not end, which still ends
// later on its own.
func TestTaskStopCancelsThenWaits(t *testing.T) {
	defer goleak.VerifyNone(t)
	var returned atomic.Bool
	task := Run(context.Background(), func(ctx context.Context) {
		<-ctx.Done()
		time.Sleep(10 * time.Millisecond) // cleanup after the cancel
		returned.Store(true)
	})
	select {
	case <-task.Done():
		t.Fatal("Done before Stop")
	default:
	}
	task.Stop()
	if !returned.Load() {
		t.Fatal("Stop returned before the goroutine did")
	}
	task.Stop()

	own := Run(context.Background(), func(context.Context) {})
	<-own.Done()
	own.Stop()

	release := make(chan struct{})
	stuck := Run(context.Background(), func(context.Context) { <-release })
	if stuck.StopWithin(20 * time.Millisecond) {
		t.Fatal("StopWithin reported a goroutine that ignores its context as returned")
	}
	close(release)
	<-stuck.Done()
	if !Run(context.Background(), func(ctx context.Context) { <-ctx.Done() }).StopWithin(time.Minute) {
		t.Fatal("StopWithin gave up on a goroutine that ends with its context")
	}
}

// RunAfter starts nothing before its delay: stopped sooner, its function
// never runs and Stop returns at once; otherwise it runs as Run's does, and
// Stop cancels it, then waits.
func TestRunAfterStartsOnlyAfterItsDelay(t *testing.T) {
	defer goleak.VerifyNone(t)
	var ran atomic.Bool
	early := RunAfter(context.Background(), time.Hour, func(context.Context) { ran.Store(true) })
	early.Stop()
	early.Stop()
	<-early.Done()
	if ran.Load() {
		t.Fatal("a Task stopped before its delay ran its function")
	}
	started := make(chan struct{})
	var returned atomic.Bool
	late := RunAfter(context.Background(), time.Millisecond, func(ctx context.Context) {
		close(started)
		<-ctx.Done()
		time.Sleep(10 * time.Millisecond) // cleanup after the cancel
		returned.Store(true)
	})
	<-started
	late.Stop()
	if !returned.Load() {
		t.Fatal("Stop returned before the started goroutine did")
	}
}

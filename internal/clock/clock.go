// Package clock is the seam between pgfence's time arithmetic and the
// machine's clock, so that tests can move time with a Fake instead of
// sleeping. Each decision reads one clock, named where it is made:
//
//   - Expiry of a lease, and who holds it: the database's clock, never
//     this machine's (the statements compare with now()).
//   - A lease's local trust window (lock): the client's Clock.
//   - A schedule's slots, catch-up and overrun (runner): the runner's Clock.
//   - Pacing of database work (renewal and poll intervals, heartbeats and
//     the settling of a view, a listener's linger, a singleton term's
//     coming of age, backoff sleeps, statement timeouts, waiting out a
//     freed lease's deferral): the real clock, through time's timers, since
//     the database's expiry that they keep pace with runs in real time.
//   - Measurements (metrics' latencies, a renewal's round trip): the real
//     monotonic clock.
package clock

import (
	"sort"
	"sync"
	"time"
)

// Clock tells the time and runs functions after a while.
type Clock interface {
	// Now is the current time (with a monotonic reading on the real clock).
	Now() time.Time
	// AfterFunc runs f in its own goroutine once d has passed.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a function scheduled by AfterFunc, as *time.Timer.
type Timer interface {
	// Stop cancels it; it reports whether it was still pending.
	Stop() bool
	// Reset schedules it again, d from now; it reports whether it was
	// still pending.
	Reset(d time.Duration) bool
}

type real struct{}

// Real is the machine's clock.
func Real() Clock { return real{} }

func (real) Now() time.Time { return time.Now() }

func (real) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }

// Fake is a clock that moves only when told to (Advance). Its timers' functions run
// in Advance's goroutine, in the order they fall due, so a test sees their
// effects as soon as Advance returns. It is safe for concurrent use.
type Fake struct {
	mu     sync.Mutex
	now    time.Time
	timers map[*fakeTimer]struct{}
}

// NewFake returns a fake clock that reads start.
func NewFake(start time.Time) *Fake {
	return &Fake{now: start, timers: make(map[*fakeTimer]struct{})}
}

// Now returns the fake time.
func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

// AfterFunc schedules fn for d from the fake now.
func (f *Fake) AfterFunc(d time.Duration, fn func()) Timer {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := &fakeTimer{f: f, at: f.now.Add(d), fn: fn}
	f.timers[t] = struct{}{}
	return t
}

// Advance moves the clock on by d and runs the functions of the timers
// that fall due, each at its time, earliest first.
func (f *Fake) Advance(d time.Duration) {
	f.mu.Lock()
	end := f.now.Add(d)
	f.mu.Unlock()
	for {
		f.mu.Lock()
		var due []*fakeTimer
		for t := range f.timers {
			if !t.at.After(end) {
				due = append(due, t)
			}
		}
		if len(due) == 0 {
			f.now = end
			f.mu.Unlock()
			return
		}
		sort.Slice(due, func(i, j int) bool { return due[i].at.Before(due[j].at) })
		t := due[0]
		delete(f.timers, t)
		if t.at.After(f.now) {
			f.now = t.at
		}
		f.mu.Unlock()
		t.fn() // outside the lock: it may read the clock or reset timers
	}
}

// Jump moves the clock on by d at once, then runs the functions of the
// timers that fell due, earliest first: each sees the new time, as a
// process frozen for d sees its timers fire late.
func (f *Fake) Jump(d time.Duration) {
	f.mu.Lock()
	f.now = f.now.Add(d)
	f.mu.Unlock()
	f.Advance(0)
}

type fakeTimer struct {
	f  *Fake
	at time.Time
	fn func()
}

func (t *fakeTimer) Stop() bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	_, pending := t.f.timers[t]
	delete(t.f.timers, t)
	return pending
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	_, pending := t.f.timers[t]
	t.at = t.f.now.Add(d)
	t.f.timers[t] = struct{}{}
	return pending
}

// Pending is how many timers are armed and not yet run: a test waits for
// it to reach n before advancing, so that the goroutine it drives has
// armed its timer.
func (f *Fake) Pending() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.timers)
}

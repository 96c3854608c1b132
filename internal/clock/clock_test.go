package clock

import (
	"runtime"
	"testing"
	"time"
)

// Advance runs due timers in order, each seeing the clock at its time;
// stopped timers do not run; a reset one runs at its new time.
func TestFakeRunsDueTimersInOrder(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	f := NewFake(t0)
	var got []time.Duration
	rec := func() { got = append(got, f.Now().Sub(t0)) }
	f.AfterFunc(3*time.Second, rec)
	f.AfterFunc(time.Second, rec)
	stopped := f.AfterFunc(2*time.Second, rec)
	moved := f.AfterFunc(time.Hour, rec)
	if !stopped.Stop() || stopped.Stop() {
		t.Fatal("Stop's report")
	}
	moved.Reset(4 * time.Second)
	f.Advance(3500 * time.Millisecond)
	if len(got) != 2 || got[0] != time.Second || got[1] != 3*time.Second {
		t.Fatalf("after 3.5s: %v, want [1s 3s]", got)
	}
	if f.Now().Sub(t0) != 3500*time.Millisecond {
		t.Fatalf("now = %v", f.Now().Sub(t0))
	}
	f.Advance(time.Second)
	if len(got) != 3 || got[2] != 4*time.Second {
		t.Fatalf("after 4.5s: %v, want the reset timer at 4s", got)
	}
}

// Pending counts the armed timers, so that a test can wait for a goroutine
// to arm one before advancing; a timer that ran or was stopped is not
// pending.
func TestPendingCountsArmedTimers(t *testing.T) {
	f := NewFake(time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))
	fired := make(chan struct{})
	go f.AfterFunc(time.Minute, func() { close(fired) })
	for f.Pending() == 0 {
		runtime.Gosched()
	}
	stopped := f.AfterFunc(time.Hour, func() {})
	if f.Pending() != 2 {
		t.Fatalf("%d pending, want 2", f.Pending())
	}
	f.Advance(time.Minute)
	<-fired
	stopped.Stop()
	if f.Pending() != 0 {
		t.Fatalf("%d timers left pending", f.Pending())
	}
}

// Jump moves the clock first: a timer that falls due sees the new time,
// where Advance shows it its own.
func TestJumpFiresTimersLate(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name string
		move func(*Fake)
		want time.Time
	}{
		{"Advance", func(f *Fake) { f.Advance(3 * time.Minute) }, start.Add(time.Minute)},
		{"Jump", func(f *Fake) { f.Jump(3 * time.Minute) }, start.Add(3 * time.Minute)},
	} {
		f := NewFake(start)
		var seen time.Time
		f.AfterFunc(time.Minute, func() { seen = f.Now() })
		tc.move(f)
		if !seen.Equal(tc.want) || !f.Now().Equal(start.Add(3*time.Minute)) {
			t.Errorf("%s: the timer saw %v (want %v), the clock is at %v", tc.name, seen, tc.want, f.Now())
		}
	}
}

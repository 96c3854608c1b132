package clock

import (
	"context"
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

// Sleep returns true once the fake clock has moved past d, and false at
// once when its context ends first.
func TestSleepOnAFake(t *testing.T) {
	f := NewFake(time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))
	done := make(chan bool)
	go func() { done <- Sleep(context.Background(), f, time.Minute) }()
	for f.Pending() == 0 {
		runtime.Gosched()
	}
	f.Advance(59 * time.Second)
	select {
	case <-done:
		t.Fatal("woke before its minute")
	default:
	}
	f.Advance(time.Second)
	if !<-done {
		t.Fatal("Sleep reported false after the full minute")
	}
	if f.Pending() != 0 {
		t.Fatalf("%d timers left armed", f.Pending())
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Sleep(ctx, f, time.Hour) {
		t.Fatal("Sleep on an ended context reported true")
	}
	if f.Pending() != 0 {
		t.Fatal("an abandoned Sleep left its timer armed")
	}
}

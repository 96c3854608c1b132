package wait

import (
	"context"
	"testing"
	"time"
)

// Detached keeps ctx's values, not its cancellation, and ends after
// CleanupTimeout; Tidy likewise, after PastDeadline.
func TestDetachedAndTidy(t *testing.T) {
	type key struct{}
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), key{}, "v"))
	d, dcancel := Detached(parent)
	defer dcancel()
	cancel()
	if d.Err() != nil || d.Value(key{}) != "v" {
		t.Fatalf("Detached after its parent's cancellation: err %v, value %v", d.Err(), d.Value(key{}))
	}
	if dl, ok := d.Deadline(); !ok || time.Until(dl) > CleanupTimeout || time.Until(dl) < CleanupTimeout-time.Second {
		t.Fatalf("Detached's deadline %v, want about CleanupTimeout from now", dl)
	}
	tidy, tcancel := Tidy(parent)
	defer tcancel()
	if tidy.Err() != nil || tidy.Value(key{}) != "v" {
		t.Fatalf("Tidy after its parent's cancellation: err %v, value %v", tidy.Err(), tidy.Value(key{}))
	}
	if dl, ok := tidy.Deadline(); !ok || time.Until(dl) > PastDeadline {
		t.Fatalf("Tidy's deadline %v, want at most PastDeadline from now", dl)
	}
}

// Outlive keeps ctx's values and ends PastDeadline after ctx ends (not
// before), or after its own bound when ctx lives on.
func TestOutlive(t *testing.T) {
	type key struct{}
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), key{}, "v"))
	defer cancel()
	out, ocancel := Outlive(parent, time.Hour)
	defer ocancel()
	if out.Value(key{}) != "v" {
		t.Fatal("Outlive lost ctx's values")
	}
	ended := time.Now()
	cancel()
	if out.Err() != nil {
		t.Fatal("Outlive ended with ctx, not PastDeadline after it")
	}
	select {
	case <-out.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("Outlive did not end after ctx ended")
	}
	if took := time.Since(ended); took < PastDeadline {
		t.Fatalf("Outlive ended %v after ctx, before PastDeadline", took)
	}

	bounded, bcancel := Outlive(context.Background(), 10*time.Millisecond)
	defer bcancel()
	select {
	case <-bounded.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("Outlive did not end at its own bound")
	}
}

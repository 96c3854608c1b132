package wait

import (
	"context"
	"testing"
	"time"
)

// Detached keeps ctx's values, not its cancellation, and ends after
// CleanupTimeout; Cleanup is ctx while it lives, and Detached after.
func TestDetachedAndCleanup(t *testing.T) {
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
	live := context.Background()
	if c, cc := Cleanup(live); c != live {
		t.Fatal("Cleanup of a live context is not that context")
	} else {
		cc()
	}
	c, cc := Cleanup(parent)
	defer cc()
	if c.Err() != nil || c.Value(key{}) != "v" {
		t.Fatalf("Cleanup of an ended context: err %v", c.Err())
	}
}

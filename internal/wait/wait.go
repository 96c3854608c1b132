// Package wait holds the one timing helper the packages share.
package wait

import (
	"context"
	"time"
)

// Sleep waits for d or until ctx ends, and reports whether the full d passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

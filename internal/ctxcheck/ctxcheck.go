// Package ctxcheck refuses a nil context at pgfence's exported edges, where
// it would otherwise panic deep inside pgx (or in a goroutine of its own).
// Package fence cannot use it (it imports fence) and checks on its own.
package ctxcheck

import (
	"context"
	"fmt"

	"github.com/pgfence/pgfence/fence"
)

// NotNil returns nil for a non-nil ctx, and otherwise fence.ErrNilContext
// wrapped with op, the call's area and name ("lock: TryAcquire").
func NotNil(ctx context.Context, op string) error {
	if ctx == nil {
		return fmt.Errorf("%s: %w", op, fence.ErrNilContext)
	}
	return nil
}

// Package ctxcheck refuses a nil context at pgfence's exported edges, where
// it would otherwise panic deep inside pgx (or in a goroutine of its own).
// It sits below every public package: fence re-exports its sentinel as
// fence.ErrNilContext and uses NotNil like the others.
package ctxcheck

import (
	"context"
	"errors"
	"fmt"
)

// ErrNilContext is fence.ErrNilContext: see there.
var ErrNilContext = errors.New("pgfence: nil context")

// NotNil returns nil for a non-nil ctx, and otherwise ErrNilContext
// wrapped with op, the call's area and name ("lock: TryAcquire").
func NotNil(ctx context.Context, op string) error {
	if ctx == nil {
		return fmt.Errorf("%s: %w", op, ErrNilContext)
	}
	return nil
}

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

// CleanupTimeout bounds cleanup work that must still happen after the
// caller's context has ended: releasing a lease at shutdown, recording a
// run's outcome, abandoning an acquisition whose reply was lost.
const CleanupTimeout = 5 * time.Second

// Detached returns a context for cleanup that must happen whatever becomes
// of ctx (recording an outcome, freeing a lease, asking the server about a
// lost reply): ctx's values without its cancellation or deadline, ending
// after CleanupTimeout.
func Detached(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), CleanupTimeout)
}

// PastDeadline bounds what a call does after its caller's context has
// ended to leave things tidy (cancel its statement at the server, name what
// blocked it): a caller's deadline is its budget, and a call returns within
// this much of it whatever the network does.
const PastDeadline = 500 * time.Millisecond

// Tidy returns a context for that work: ctx's values, ending PastDeadline
// from now.
func Tidy(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), PastDeadline)
}

// Outlive returns a context for a step whose outcome is worth learning
// even as ctx ends (whether a session it ends was ended): ctx's values,
// ending PastDeadline after ctx ends, and after max at the latest. A
// caller that waits for the step so waits at most PastDeadline past its
// deadline.
func Outlive(ctx context.Context, max time.Duration) (context.Context, context.CancelFunc) {
	out, cancel := context.WithTimeout(context.WithoutCancel(ctx), max)
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(PastDeadline, cancel) })
	return out, func() {
		stop()
		cancel()
	}
}

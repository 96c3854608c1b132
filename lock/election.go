package lock

import (
	"context"
	"errors"
	"time"

	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/wait"
)

// Election runs a function on exactly one client at a time: Run campaigns for
// the lease Name, calls Lead while it holds it, and campaigns again after each
// term, until its context ends.
//
//	e := &lock.Election{Client: c, Name: "billing", Lead: func(ctx context.Context, l *lock.Lease) error {
//		// ... act only while ctx is live, with l.Token() on every write ...
//		<-ctx.Done()
//		return nil
//	}}
//	err := e.Run(ctx)
type Election struct {
	// Client acquires and renews the lease. Required.
	Client *Client

	// Name is the lease campaigned for. Required.
	Name string

	// Lead runs while this client leads. Its context is cancelled when the
	// lease is lost (cause wraps ErrLeaseLost) or Run's context ends. When
	// Lead returns, for whatever reason, the term ends: the lease is
	// released and, unless Run's context has ended, the client campaigns
	// again after RetryDelay. Required.
	Lead func(ctx context.Context, l *Lease) error

	// OnStop, if set, runs after every term, whatever ended it, with the
	// lease and the error that ended the term (Lead's error, or the cause of
	// the lease's loss, or nil). It runs after the lease has been released.
	OnStop func(l *Lease, err error)

	// RetryDelay is the pause between the end of a term and the next
	// campaign, so that a leader whose Lead fails at once does not grab the
	// lease straight back. Default 1s; negative means no pause.
	RetryDelay time.Duration
}

// ErrInvalidElection is returned by Run when a required field is missing.
var ErrInvalidElection = errors.New("lock: invalid election")

// Run campaigns and leads until ctx ends, then returns nil; the lease is
// released at the end of every term. It returns an error for a bad
// Election or lease name, and for a permanent database error (the package
// documentation).
func (e *Election) Run(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "lock: Election.Run"); err != nil {
		return err
	}
	switch {
	case e.Client == nil:
		return errors.Join(ErrInvalidElection, errors.New("Client is nil"))
	case e.Lead == nil:
		return errors.Join(ErrInvalidElection, errors.New("Lead is nil"))
	}
	delay := e.RetryDelay
	if delay == 0 {
		delay = time.Second
	}
	for {
		l, err := e.Client.Acquire(ctx, e.Name)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		err = e.term(ctx, l)
		if e.OnStop != nil {
			e.OnStop(l, err)
		}
		if ctx.Err() != nil {
			return nil
		}
		if delay > 0 && !wait.Sleep(ctx, delay) {
			return nil
		}
	}
}

// term runs one leadership term and always releases the lease afterwards.
func (e *Election) term(ctx context.Context, l *Lease) error {
	lctx, cancel := context.WithCancelCause(l.Context())
	stop := context.AfterFunc(ctx, func() { cancel(context.Cause(ctx)) })
	defer stop()
	err := e.Lead(lctx, l)
	cancel(nil)
	if err == nil {
		if lost := l.Err(); lost != nil && !errors.Is(lost, ErrReleased) {
			err = lost
		}
	}
	_ = l.Release(ctx) // once ctx has ended, in the background (Release)
	return err
}

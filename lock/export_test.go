package lock

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/idleholder"
)

// AcquireLostReply acquires name the way an attempt whose reply was lost
// does: the row is taken with a fresh secret under the client's session,
// then the client forgets the lease (no release, no lease handle). It
// returns that secret and the token issued.
func (c *Client) AcquireLostReply(ctx context.Context, name string) ([]byte, int64, error) {
	secret := newSecret()
	l, err := c.tryAcquire(ctx, name, secret)
	if err != nil {
		return nil, 0, err
	}
	l.mu.Lock()
	l.ended = true
	l.mu.Unlock()
	l.cancel(ErrReleased)
	c.untrack(l)
	return secret, int64(l.token), nil
}

// TryAcquireAs is one attempt of Acquire that uses secret.
func (c *Client) TryAcquireAs(ctx context.Context, name string, secret []byte) (*Lease, error) {
	return c.tryAcquire(ctx, name, secret)
}

// SetClock makes the client read the time and arm its trust-window timers
// on clk; call it before the first acquisition.
func (c *Client) SetClock(clk clock.Clock) { c.clock = clk }

// ForceReleaseLooking is ForceRelease that counts its looks for idle
// holders that end without error in succeeded.
func ForceReleaseLooking(ctx context.Context, pool *pgxpool.Pool, schema, name string, succeeded *atomic.Uint64) (Freed, error) {
	return forceRelease(ctx, pool, schema, name, func(err error) {
		if err == nil {
			succeeded.Add(1)
		}
	})
}

// EndIdleHolders is the idle-holder look of an acquisition on backend
// waiter, with schema's statements, on db.
func EndIdleHolders(ctx context.Context, db fence.DB, schema, name string, after time.Duration, waiter int64) ([]Backend, error) {
	ended, err := idleholder.End(ctx, ctx, db, schema, name, after, &waiter)
	return backends(ended), err
}

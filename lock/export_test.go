package lock

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/pgfence/pgfence/internal/clock"
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

// looks counts the looks for idle holders by lease name: name → *lookCount.
var looks sync.Map

type lookCount struct{ started, succeeded atomic.Uint64 }

func init() {
	h := func(name string, done bool, err error) {
		n, _ := looks.LoadOrStore(name, new(lookCount))
		switch c := n.(*lookCount); {
		case !done:
			c.started.Add(1)
		case err == nil:
			c.succeeded.Add(1)
		}
	}
	lookHook.Store(&h)
}

// IdleHolderLooks is how many looks for idle holders of lease name every
// client has made without error, and how many have started.
func IdleHolderLooks(name string) (succeeded, started uint64) {
	if n, ok := looks.Load(name); ok {
		c := n.(*lookCount)
		return c.succeeded.Load(), c.started.Load()
	}
	return 0, 0
}

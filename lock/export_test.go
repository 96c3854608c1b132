package lock

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgfence/pgfence/internal/clock"
)

// AcquireLostReply acquires name the way an attempt whose reply was lost
// does: the row is taken with a fresh secret, then the client forgets the
// lease (no renewal, no release, no lease handle). It returns that secret,
// the attempt's send time and the token issued.
func (c *Client) AcquireLostReply(ctx context.Context, name string) ([]byte, time.Time, int64, error) {
	secret, sent := newSecret(), c.clock.Now()
	l, err := c.tryAcquire(ctx, name, secret, time.Time{})
	if err != nil {
		return nil, sent, 0, err
	}
	l.mu.Lock()
	l.ended = true
	l.timer.Stop()
	l.mu.Unlock()
	l.cancel(ErrReleased)
	c.untrack(l)
	return secret, sent, int64(l.token), nil
}

// TryAcquireAs is one attempt of Acquire that uses secret, whose first
// attempt was sent at since.
func (c *Client) TryAcquireAs(ctx context.Context, name string, secret []byte, since time.Time) (*Lease, error) {
	return c.tryAcquire(ctx, name, secret, since)
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

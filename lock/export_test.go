package lock

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
)

// AcquireLostReply acquires name the way an attempt whose reply was lost
// does: the row is taken with a fresh secret, and no Lease is made of it. It
// returns that secret, the attempt's send time and the token issued.
func (c *Client) AcquireLostReply(ctx context.Context, name string) ([]byte, time.Time, int64, error) {
	secret, sent := newSecret(), time.Now()
	var (
		token     int64
		expiresAt time.Time
	)
	args := []any{name, c.cfg.Holder, secret, c.cfg.TTL.Microseconds()}
	r, err := c.compareAndSet(ctx, args, &token, &expiresAt)
	if err == nil && !r.won {
		err = c.pool.QueryRow(ctx, c.q.acquireNew, args...).Scan(&token, &expiresAt)
		if errors.Is(err, pgx.ErrNoRows) {
			err = errors.New("lease is held")
		}
	}
	return secret, sent, token, err
}

// TryAcquireAs is one attempt of Acquire that uses secret, whose first
// attempt was sent at since.
func (c *Client) TryAcquireAs(ctx context.Context, name string, secret []byte, since time.Time) (*Lease, error) {
	return c.tryAcquire(ctx, name, secret, since)
}

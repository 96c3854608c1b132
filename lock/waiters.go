package lock

import (
	"context"
	"time"

	"github.com/pgfence/pgfence/internal/notify"
	"github.com/pgfence/pgfence/internal/retry"
)

// listenerLinger is how long the listening connection stays open after
// the last waiter has gone, so a wait does not cost a connect.
const listenerLinger = 30 * time.Second

// newWaiters returns the hub (package notify) of a client's blocked
// Acquires, Watches and Observes, by lease name. Its poller covers the
// Acquires' leases with one statement per PollInterval whatever their
// number: it asks each held lease's release to NOTIFY (waiters_until).
func newWaiters(c *Client) *notify.Hub {
	return notify.New(c.bg, c.pool, notify.Config{
		Schema:        c.cfg.Schema,
		Bound:         c.cfg.TTL,
		Linger:        listenerLinger,
		MaxBackoff:    c.cfg.PollInterval,
		Poll:          c.pollWaited,
		Backoff:       c.backoff,
		Log:           c.log,
		Failed:        "pgfence: release listener failed, reconnecting; waiters poll meanwhile",
		Recovered:     "pgfence: release listener listening again",
		PollFailed:    "pgfence: polling for released leases failing; waiters still wake on release",
		PollRecovered: "pgfence: polling for released leases recovered",
	})
}

// pollWaited runs the poll statement, and returns the free leases among
// names and when to poll next (at the latest, just after the soonest
// expiry).
func (c *Client) pollWaited(ctx context.Context, names []string) ([]string, time.Duration, error) {
	iv := c.cfg.PollInterval
	next := retry.Spread(iv)
	rows, err := c.pool.Query(ctx, c.q.pollWaited, names, (4 * iv).Microseconds(), (2 * iv).Microseconds())
	if err != nil {
		return nil, next, err
	}
	defer rows.Close()
	var free []string
	for rows.Next() {
		var (
			name      string
			isFree    bool
			expiresIn int64
		)
		if err := rows.Scan(&name, &isFree, &expiresIn); err != nil {
			return nil, next, err
		}
		if isFree {
			free = append(free, name)
		} else if d := time.Duration(expiresIn)*time.Microsecond + time.Millisecond; d < next {
			next = d
		}
	}
	return free, next, rows.Err()
}

// Watch returns a channel that receives a value whenever a release of the
// lease name is announced (Release, ForceRelease, or a statement calling
// the schema's pgfence_wake_waiters(name)), and a function that stops
// watching, on the client's one listening connection. Announcements are
// merged while one is pending, and may be missed while the connection is
// re-established (every watcher is woken once then): react sooner with
// it, but do not rely on it alone.
func (c *Client) Watch(name string) (<-chan struct{}, func()) {
	w := c.waits.Subscribe(name)
	return w.C, w.Cancel
}

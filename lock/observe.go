package lock

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/notify"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
)

// Observe reports who holds the lease name, without campaigning for it (as
// etcd's Observe): the channel receives the lease's state at once, then
// whenever its holder, token or liveness changes, until ctx ends or the
// client closes, when it is closed. A lease never acquired reads as
// Info{Name: name}. Acquisitions of an observed lease notify, so a new
// holder is seen within milliseconds; a read every PollInterval (and at
// the expiry) catches the rest: a statement per PollInterval per observer.
// The channel holds the newest state. Transient errors are retried (logged
// once per failure period); a permanent one is logged and ends it.
func (c *Client) Observe(ctx context.Context, name string) (<-chan Info, error) {
	if err := ctxcheck.NotNil(ctx, "lock: Observe"); err != nil {
		return nil, err
	}
	if err := fence.ValidateName(name); err != nil {
		return nil, err
	}
	out := make(chan Info, 1)
	sub := c.waits.Subscribe(name)
	ok := c.bg.Go(func(gctx context.Context) {
		defer close(out)
		defer sub.Cancel()
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		stop := context.AfterFunc(gctx, cancel) // the client's Close ends it too
		defer stop()
		c.observe(ctx, name, sub, out)
	})
	if !ok {
		sub.Cancel()
		return nil, ErrClosed
	}
	return out, nil
}

func (c *Client) observe(ctx context.Context, name string, sub *notify.Sub, out chan Info) {
	var (
		last    Info
		sent    bool
		failing retry.Failing
	)
	poll := c.cfg.PollInterval
	for {
		i, err := c.observeOnce(ctx, name, poll)
		next := poll
		switch {
		case err == nil:
			failing.Recover(c.log, "pgfence: observe recovered", "lease", name)
			if !sent || i.Holder != last.Holder || i.Token != last.Token || i.Held != last.Held {
				latest(out, i)
				last, sent = i, true
			}
			if i.Held && i.ExpiresIn < next {
				next = max(i.ExpiresIn, 0) + time.Millisecond // look again as it expires
			}
		case ctx.Err() != nil:
			return
		case !retry.Transient(err):
			c.log.Error("pgfence: observe stopped on a permanent error", "lease", name, "err", err)
			return
		default:
			failing.Fail(c.log, "pgfence: observe failing; retrying", err, "lease", name)
			next = c.backoff.Wait(failing.Count() - 1)
		}
		if !backoffOrWake(ctx, next, sub) {
			return
		}
	}
}

// observeOnce marks the lease as observed for two intervals and reads it.
func (c *Client) observeOnce(ctx context.Context, name string, poll time.Duration) (Info, error) {
	ctx, cancel := context.WithTimeout(ctx, max(poll, wait.CleanupTimeout))
	defer cancel()
	rows, err := c.pool.Query(ctx, c.q.observe, name, (2 * poll).Microseconds(), poll.Microseconds())
	if err != nil {
		return Info{}, c.explain(err)
	}
	i, err := pgx.CollectExactlyOneRow(rows, scanInfo)
	if errors.Is(err, pgx.ErrNoRows) {
		return Info{Name: name}, nil
	}
	if err != nil {
		return Info{}, c.explain(err)
	}
	return i, nil
}

// latest puts i in out, replacing a state the reader has not taken yet.
// Only one goroutine sends on out.
func latest(out chan Info, i Info) {
	select {
	case <-out:
	default:
	}
	out <- i
}

package lock

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/wait"
)

// Acquisitions whose outcome is unknown: the statement may have reached the
// server and got no answer.

// inFlightError is the error of an acquisition statement that may have
// reached the server and got no answer (the context ended, or the connection
// broke): the database may still grant it. pid is the backend that ran it.
type inFlightError struct {
	pid uint32
	err error
}

func (e *inFlightError) Error() string { return e.err.Error() }
func (e *inFlightError) Unwrap() error { return e.err }

// inFlight wraps err in an *inFlightError when the statement sent on
// backend pid may nevertheless have been executed: no server answer says it
// failed, and it was not refused before being sent.
func inFlight(err error, pid uint32) error {
	var pg *pgconn.PgError
	if err == nil || errors.As(err, &pg) || pgconn.SafeToRetry(err) {
		return err
	}
	return &inFlightError{pid: pid, err: err}
}

// inDoubt reports whether a failed acquisition may nevertheless have been
// granted, and on which backend.
func inDoubt(err error) (pid uint32, ok bool) {
	var f *inFlightError
	if errors.As(err, &f) {
		return f.pid, true
	}
	return 0, false
}

// abandon frees the lease name if it is held with secret: an acquisition
// whose outcome is unknown, by a caller that has given up on it. Closing the
// client side of a connection does not stop the server: it still runs (and
// commits) what it had received, and may not even have started when the
// client gave up. So abandon first waits until backend pid has exited (pgx
// closed the connection; the backend ends once it has processed its input),
// then frees the lease by its secret (known only to that acquisition). If the
// backend lingers (a partition: its socket is not closed yet), it frees the
// lease at the end of wait.CleanupTimeout anyway, and the lease's TTL covers
// the rest. It runs in the background, owned by the client (Close waits).
func (c *Client) abandon(name string, secret []byte, pid uint32) {
	run := func(ctx context.Context) {
		wctx, wcancel := context.WithTimeout(ctx, wait.CleanupTimeout*4/5)
		_ = c.afterBackend(wctx, pid)
		wcancel()
		_, err := c.pool.Exec(ctx, c.q.releaseSecret, name, secret)
		if err != nil {
			c.log.Warn("pgfence: could not free an acquisition whose outcome was unknown; it expires by TTL",
				"lease", name, "err", err)
		}
	}
	// It must run even if Close has begun (it frees a lease): it ignores
	// the group's cancellation, and Close waits for it. Once the group has
	// stopped, the lease's TTL frees it: the caller (an acquisition whose
	// context has ended) is not held.
	if !c.bg.Go(func(context.Context) {
		ctx, cancel := wait.Detached(context.Background())
		defer cancel()
		run(ctx)
	}) {
		c.log.Warn("pgfence: the client is closed: an acquisition whose outcome was unknown expires by its TTL", "lease", name)
	}
}

// afterBackend waits until backend pid has exited.
func (c *Client) afterBackend(ctx context.Context, pid uint32) error {
	for {
		var alive bool
		if err := c.pool.QueryRow(ctx, c.q.backendAlive, int64(pid)).Scan(&alive); err != nil {
			return err
		}
		if !alive {
			return nil
		}
		if !wait.Sleep(ctx, 5*time.Millisecond) {
			return ctx.Err()
		}
	}
}

package lock

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/outcome"
	"github.com/pgfence/pgfence/internal/wait"
)

// inFlightError is the error of an acquisition that may have reached
// backend pid, with no answer proving it failed: it may be granted.
type inFlightError struct {
	pid uint32
	err error
}

func (e *inFlightError) Error() string { return e.err.Error() }
func (e *inFlightError) Unwrap() error { return e.err }

// inFlight wraps the error of a statement sent on conn unless the server
// answered it (an ERROR; a FATAL may follow a commit), or pgx did not send
// it (SafeToRetry on a connection still open: a context already done).
// SafeToRetry alone proves nothing: pgx reports a simple-protocol
// statement whose connection was reset after the server ran it as never
// sent, as it does a COMMIT (package outcome).
func inFlight(err error, conn *pgconn.PgConn) error {
	var pg *pgconn.PgError
	switch {
	case err == nil, errors.As(err, &pg) && !outcome.Fatal(pg), pgconn.SafeToRetry(err) && !conn.IsClosed():
		return err
	}
	return &inFlightError{pid: conn.PID(), err: err}
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

// abandon frees, in the client's background, the lease name if it is held
// with secret: an acquisition whose outcome is unknown. The server still
// runs what it had received, so abandon first waits (within
// wait.CleanupTimeout) until backend pid has exited, then frees the lease;
// the lease's TTL covers a backend that lingers longer.
func (c *Client) abandon(name string, secret []byte, pid uint32) {
	// It runs even once Close has begun, and Close waits for it.
	if !c.bg.Go(func(context.Context) {
		ctx, cancel := wait.Detached(context.Background())
		defer cancel()
		wctx, wcancel := context.WithTimeout(ctx, wait.CleanupTimeout*4/5)
		c.afterBackend(wctx, pid)
		wcancel()
		_, err := c.pool.Exec(ctx, c.q.releaseSecret, name, secret)
		if err != nil {
			c.log.Warn("pgfence: could not free an acquisition whose outcome was unknown; it expires by TTL",
				"lease", name, "err", err)
		}
	}) {
		c.log.Warn("pgfence: the client is closed: an acquisition whose outcome was unknown expires by its TTL", "lease", name)
	}
}

// afterBackend waits until backend pid has exited, ctx ends, or asking fails.
func (c *Client) afterBackend(ctx context.Context, pid uint32) {
	for {
		var alive bool
		if err := c.pool.QueryRow(ctx, c.q.backendAlive, int64(pid)).Scan(&alive); err != nil || !alive {
			return
		}
		if !wait.Sleep(ctx, 5*time.Millisecond) {
			return
		}
	}
}

package lock

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/pgfence/pgfence/internal/ctxcheck"
)

// ErrUnhealthy is matched by every error Health returns for a client that
// is not healthy (the error says why).
var ErrUnhealthy = errors.New("lock: unhealthy")

// Health says whether the client can do its work, for a readiness probe:
// nil, or an error matching ErrUnhealthy that says why: it is closed, the
// database does not answer a ping (through the client's pool) within ctx,
// or, while it holds leases, its renewals are failing or late (less trust
// left than min(RenewInterval, (TTL - SafetyMargin - RenewInterval)/2)).
func (c *Client) Health(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "lock: Health"); err != nil {
		return err
	}
	if _, closed := c.state(); closed {
		return fmt.Errorf("%w: %w", ErrUnhealthy, ErrClosed)
	}
	var why []error
	if err := c.pool.Ping(ctx); err != nil {
		why = append(why, fmt.Errorf("the database does not answer: %w", err))
	}
	if s, _ := c.state(); s != nil && s.count() > 0 {
		if c.failing.Load() {
			why = append(why, errors.New("renewals are failing"))
		}
		if left, slack := s.left(c.clock.Now()), c.cfg.window().lateSlack(); left < slack {
			why = append(why, fmt.Errorf("renewals are late: the session holding %d leases has %v of its trust window left (less than %v)",
				s.count(), left.Round(time.Millisecond), slack))
		}
	}
	if len(why) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrUnhealthy, errors.Join(why...))
}

// HealthHandler serves check as a readiness endpoint: 200 "ok", or 503
// with the error, as plain text, each check bounded by timeout (5s if 0 or
// less): http.Handle("/readyz", lock.HealthHandler(client.Health, 2*time.Second)).
func HealthHandler(check func(ctx context.Context) error, timeout time.Duration) http.Handler {
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), timeout)
		defer cancel()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if err := check(ctx); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintln(w, err)
			return
		}
		_, _ = fmt.Fprintln(w, "ok")
	})
}

package lock_test

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// Health is nil for a client that renews on time, says "renewals are late"
// while its renewals are held up (the leases table locked by another
// session) before the lease is lost, recovers, and says closed once
// closed; HealthHandler serves it as 200 or 503.
func TestHealth(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	// TTL 6 s: renewals are late (under 1.7 s of trust left) for 1.7 s
	// before the lease is lost, a window a loaded machine does not miss
	// (with TTL 2 s it was 0.57 s, and once was missed).
	c := newClient(t, db, lock.Config{TTL: 6 * time.Second})
	l, err := c.TryAcquire(ctx, "healthy")
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(lock.HealthHandler(c.Health, time.Second))
	defer srv.Close()
	probe := func() (int, string) {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if err := c.Health(ctx); err != nil {
		t.Fatalf("Health of a client renewing on time: %v", err)
	}
	if code, body := probe(); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("the handler of a healthy client: %d %q", code, body)
	}

	// Renewals held up: the sessions table locked by another session.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "LOCK TABLE "+pgx.Identifier{db.Schema, "pgfence_sessions"}.Sanitize()+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	var unhealthy error
	pgtest.Eventually(t, 15*time.Second, "Health to report late renewals", func() bool {
		unhealthy = c.Health(ctx)
		return unhealthy != nil
	})
	if !errors.Is(unhealthy, lock.ErrUnhealthy) || !strings.Contains(unhealthy.Error(), "renewals are late") {
		t.Fatalf("Health while renewals are held up: %v", unhealthy)
	}
	if l.Err() != nil {
		t.Fatalf("Health reported late renewals only once the lease was lost (%v): it must warn before", l.Err())
	}
	if code, body := probe(); code != http.StatusServiceUnavailable || !strings.Contains(body, "lock: unhealthy") {
		t.Fatalf("the handler of a client whose renewals are late: %d %q", code, body)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, 10*time.Second, "Health to recover once renewals go through", func() bool { return c.Health(ctx) == nil })

	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Health(ctx); !errors.Is(err, lock.ErrUnhealthy) || !errors.Is(err, lock.ErrClosed) {
		t.Fatalf("Health of a closed client: %v", err)
	}
}

package lock_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// newClient returns a client on db's schema, closed when the test ends.
func newClient(t testing.TB, db *pgtest.DB, cfg lock.Config) *lock.Client {
	t.Helper()
	if cfg.Schema == "" {
		cfg.Schema = db.Schema
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	pool := db.Pool
	c, err := lock.New(pool, cfg)
	if err != nil {
		t.Fatalf("lock.New: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.Close(ctx)
	})
	return c
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

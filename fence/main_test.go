package fence_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func newClient(t testing.TB, db *pgtest.DB, cfg lock.Config) *lock.Client {
	t.Helper()
	cfg.Schema = db.Schema
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	c, err := lock.New(db.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func table(db *pgtest.DB, name string) string { return pgx.Identifier{db.Schema, name}.Sanitize() }

func mustExec(t testing.TB, db *pgtest.DB, sql string, args ...any) {
	t.Helper()
	if _, err := db.Pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// expire ends a lease at the database, as if its holder had paused past TTL.
func expire(t testing.TB, db *pgtest.DB, name string) {
	t.Helper()
	mustExec(t, db, "UPDATE "+table(db, "pgfence_leases")+" SET expires_at = now() - interval '1 millisecond' WHERE name = $1", name)
}

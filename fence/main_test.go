package fence_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

func TestMain(m *testing.M) {
	if spec := os.Getenv(frozenEnv); spec != "" {
		os.Exit(frozenHolder(spec))
	}
	pgtest.Main(m)
}

func newClient(t testing.TB, db *pgtest.DB, cfg lock.Config) *lock.Client { return db.Client(t, cfg) }

func ctxT(t testing.TB, d time.Duration) context.Context { return pgtest.Context(t, d) }

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
	mustExec(t, db, expiry.SQL(db.Schema), name)
}

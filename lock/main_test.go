package lock_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

var quiet = pgtest.Quiet

func newClient(t testing.TB, db *pgtest.DB, cfg lock.Config) *lock.Client { return db.Client(t, cfg) }

func ctxT(t testing.TB, d time.Duration) context.Context { return pgtest.Context(t, d) }

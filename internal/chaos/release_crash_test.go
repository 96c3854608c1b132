package chaos

import (
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgcluster"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// A release commits without waiting for its WAL flush (unless
// Config.DurableRelease), so a crash right after it may undo it. What the
// documentation promises either way: the lease comes back exactly as it was
// before the release (same holder, token and expiry), so it cannot outlive its
// old expiry, and the next acquisition still gets a greater token. A durable
// release always survives the crash.
//
// The server crashes (pg_ctl stop -m immediate) right after Release returns,
// with the WAL writer's tick at 10 s so that an unflushed release is likely
// lost; whether it was is logged.
func TestReleaseAcrossCrash(t *testing.T) {
	srv, err := pgcluster.New("wal_writer_delay = 10000")
	pgtest.NeedTool(t, err, pgcluster.ErrNoServer)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx := pgtest.Context(t, 2*time.Minute)
	pool := connect(t, srv.URL())
	if _, err := migrations.Up(ctx, pool, "pgfence"); err != nil {
		t.Fatal(err)
	}
	newClient := func(cfg lock.Config) *lock.Client {
		cfg.Schema, cfg.TTL, cfg.Logger = "pgfence", 2*time.Second, pgtest.Quiet
		c, err := lock.New(pool, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	lost := 0
	for round := range 6 {
		durable := round%2 == 1
		c := newClient(lock.Config{DurableRelease: durable})
		l, err := c.TryAcquire(ctx, "crash")
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		// The row as the lease left it at the database.
		var expiresAt time.Time
		if err := pool.QueryRow(ctx, "SELECT expires_at FROM pgfence.pgfence_lease_states WHERE name = 'crash'").Scan(&expiresAt); err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := srv.Crash(); err != nil {
			t.Fatal(err)
		}
		_ = c.Close(ctx)
		if err := srv.Start(); err != nil {
			t.Fatal(err)
		}
		pool.Reset() // connections to the crashed server are dead

		var (
			holder *string
			token  int64
			exp    time.Time
		)
		if err := pool.QueryRow(ctx, "SELECT holder, token, expires_at FROM pgfence.pgfence_lease_states WHERE name = 'crash'").Scan(&holder, &token, &exp); err != nil {
			t.Fatalf("round %d after restart: %v", round, err)
		}
		switch {
		case holder == nil:
			// The release survived.
		case durable:
			t.Fatalf("round %d: a durable release was lost in the crash (holder %q)", round, *holder)
		default:
			lost++
			// Its session may have been renewed once more before the
			// crash (a durable commit): the expiry is then one renewal
			// later, never earlier.
			if *holder != l.Holder() || token != int64(l.Token()) || exp.Before(expiresAt) || exp.After(expiresAt.Add(2*time.Second)) {
				t.Fatalf("round %d: after the crash the row is holder %q token %d expires %v; want the lease as it was: %q, %d, %v (or one renewal later)",
					round, *holder, token, exp, l.Holder(), l.Token(), expiresAt)
			}
		}

		// The next acquisition: a greater token, and not before the old
		// expiry by the database's clock if the release was lost.
		c2 := newClient(lock.Config{PollInterval: 100 * time.Millisecond})
		l2, err := c2.Acquire(ctx, "crash")
		if err != nil {
			t.Fatalf("round %d: acquire after restart: %v", round, err)
		}
		var acquiredAt time.Time
		if err := pool.QueryRow(ctx, "SELECT acquired_at FROM pgfence.pgfence_leases WHERE name = 'crash'").Scan(&acquiredAt); err != nil {
			t.Fatal(err)
		}
		if l2.Token() <= l.Token() {
			t.Fatalf("round %d: token %d after the crash, want above %d", round, l2.Token(), l.Token())
		}
		if holder != nil && acquiredAt.Before(expiresAt) {
			t.Fatalf("round %d: re-acquired at %v, before the un-released lease's expiry %v", round, acquiredAt, expiresAt)
		}
		if err := l2.Release(ctx); err != nil {
			t.Fatal(err)
		}
		_ = c2.Close(ctx)
	}
	t.Logf("asynchronous releases undone by the crash: %d of 3; durable releases undone: 0 of 3", lost)
}

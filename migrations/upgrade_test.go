package migrations_test

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// Upgrading a live database to sessions (00005_sessions.sql): a lease held
// when the migration runs stays held, by its holder, with its token, until
// the expiry it had, and is taken over only then; expired and released
// leases are free at once; every token issued after the upgrade is above
// every token issued before; and a client of the earlier version fails its
// next renewal (the columns it updates are gone), so it ends its leases at
// its trust deadline instead of renewing them in a row nobody reads.
func TestUpgradeToSessionsKeepsHeldLeases(t *testing.T) {
	ctx := pgtest.Context(t, 2*time.Minute)
	pool := pgtest.NewPool(t, "migrations-upgrade")
	schema := pgtest.Schema(t, "upgrade")
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	p, err := migrations.NewProvider(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := p.UpTo(ctx, 4); err != nil {
		t.Fatal(err)
	}
	leases := ident.Table(schema, "pgfence_leases")
	// The rows an earlier client leaves: a lease it holds for 3 s more,
	// one that expired under it, one it released.
	rows, err := pool.Query(ctx, `INSERT INTO `+leases+` (name, holder, secret, acquired_at, renewed_at, expires_at) VALUES
		('held', 'old-client', '\x01', now() - interval '1 minute', now(), now() + interval '3 seconds'),
		('expired', 'old-client', '\x02', now() - interval '1 minute', now() - interval '10 seconds', now() - interval '1 second'),
		('released', NULL, NULL, now() - interval '1 minute', now() - interval '1 minute', now() - interval '30 seconds')
		RETURNING token`)
	if err != nil {
		t.Fatal(err)
	}
	var highest int64
	for rows.Next() {
		var tok int64
		if err := rows.Scan(&tok); err != nil {
			t.Fatal(err)
		}
		highest = max(highest, tok)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var heldToken int64
	var heldUntil time.Time
	if err := pool.QueryRow(ctx, `SELECT token, expires_at FROM `+leases+` WHERE name = 'held'`).Scan(&heldToken, &heldUntil); err != nil {
		t.Fatal(err)
	}

	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}

	// The earlier client's renewal statement now fails.
	_, err = pool.Exec(ctx, `UPDATE `+leases+` l SET renewed_at = now(), expires_at = now() + interval '3 seconds'
		WHERE l.name = 'held' AND l.token = $1 AND l.secret = '\x01' AND l.expires_at > now()`, heldToken)
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || pg.Code != "42703" {
		t.Fatalf("an earlier client's renewal after the upgrade: %v, want undefined column (42703)", err)
	}

	c, err := lock.New(pool, lock.Config{Schema: schema, Holder: "new-client", PollInterval: 100 * time.Millisecond, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	_, err = c.TryAcquire(ctx, "held")
	var he *lock.HeldError
	if !errors.As(err, &he) || he.Holder != "old-client" || int64(he.Token) != heldToken || !he.ExpiresAt.Equal(heldUntil) {
		t.Fatalf("the lease held across the upgrade: %v; want held by old-client with token %d until %v", err, heldToken, heldUntil)
	}
	for _, name := range []string{"expired", "released"} {
		l, err := c.TryAcquire(ctx, name)
		if err != nil {
			t.Fatalf("%s lease after the upgrade: %v", name, err)
		}
		if int64(l.Token()) <= highest {
			t.Fatalf("%s lease: token %s after the upgrade, not above %d issued before it", name, l.Token(), highest)
		}
	}
	l, err := c.Acquire(ctx, "held")
	if err != nil {
		t.Fatalf("the lease held across the upgrade, once it expired: %v", err)
	}
	var acquiredAt time.Time
	if err := pool.QueryRow(ctx, `SELECT acquired_at FROM `+leases+` WHERE name = 'held'`).Scan(&acquiredAt); err != nil {
		t.Fatal(err)
	}
	if acquiredAt.Before(heldUntil) || int64(l.Token()) <= highest {
		t.Fatalf("the lease held across the upgrade was taken at %v with token %s; want no earlier than its expiry %v, above %d",
			acquiredAt, l.Token(), heldUntil, highest)
	}
}

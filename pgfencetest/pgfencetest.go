// Package pgfencetest helps applications test their own code that uses
// pgfence, against a real PostgreSQL: a fresh migrated schema per test, a
// check that code runs under a lease, and the two faults fencing exists for,
// made on demand without sleeping: another holder taking the lease over, and
// the lease expiring.
//
// The database comes from PGFENCE_TEST_DATABASE_URL, else TEST_DATABASE_URL,
// else DATABASE_URL; without one, New fails the test and says how to provide
// one. It never starts containers (that stays the application's choice).
package pgfencetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// TB is the part of testing.TB the helpers use (so that their own failures
// can be observed in tests).
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Errorf(format string, args ...any)
	Cleanup(func())
}

// envURL lists the environment variables New reads, in order (see the
// package documentation).
var envURL = []string{"PGFENCE_TEST_DATABASE_URL", "TEST_DATABASE_URL", "DATABASE_URL"}

// DB is one test's pgfence schema.
type DB struct {
	// Pool connects to the database; the schema is not on its search_path:
	// pass Schema to pgfence (Client does).
	Pool *pgxpool.Pool
	// Schema holds pgfence's objects, migrated; dropped when the test ends.
	Schema string
}

// New creates a fresh schema with pgfence's migrations applied, on the
// database from the environment (see the package documentation). The schema
// and the pool go away when the test ends.
func New(tb TB) *DB {
	tb.Helper()
	db, cleanup, err := Open(context.Background())
	if err != nil {
		tb.Fatalf("pgfencetest: %v", err)
		return nil
	}
	tb.Cleanup(cleanup)
	return db
}

// ErrNoDatabase is returned by Open when the environment names no database.
var ErrNoDatabase = errors.New("no database: set PGFENCE_TEST_DATABASE_URL (or TEST_DATABASE_URL, DATABASE_URL), e.g.\n" +
	"  PGFENCE_TEST_DATABASE_URL='postgres://postgres@127.0.0.1:5432/test?sslmode=disable'")

// Open is New for code without a testing.TB (an Example, a tool): it
// returns the fresh schema and a function that drops it and closes the pool.
func Open(ctx context.Context) (*DB, func(), error) {
	var url string
	for _, v := range envURL {
		if url = os.Getenv(v); url != "" {
			break
		}
	}
	if url == "" {
		return nil, nil, ErrNoDatabase
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	db, drop, err := create(ctx, pool)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return db, func() { drop(); pool.Close() }, nil
}

// NewIn is New on a pool the caller provides and keeps (it is not
// closed): for a test suite with a database set-up of its own.
func NewIn(tb TB, pool *pgxpool.Pool) *DB {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db, drop, err := create(ctx, pool)
	if err != nil {
		tb.Fatalf("pgfencetest: %v", err)
		return nil
	}
	tb.Cleanup(drop)
	return db
}

// create makes a fresh migrated schema on pool and returns it with the
// function that drops it.
func create(ctx context.Context, pool *pgxpool.Pool) (*DB, func(), error) {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "pgfencetest_" + hex.EncodeToString(b)
	drop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		drop()
		return nil, nil, fmt.Errorf("migrate: %w", err)
	}
	return &DB{Pool: pool, Schema: schema}, drop, nil
}

// Client returns a lock client on the test's schema (cfg.Schema is set; a
// nil cfg.Logger discards), closed when the test ends.
func (db *DB) Client(tb TB, cfg lock.Config) *lock.Client {
	tb.Helper()
	cfg.Schema = db.Schema
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	c, err := lock.New(db.Pool, cfg)
	if err != nil {
		tb.Fatalf("pgfencetest: %v", err)
		return nil
	}
	tb.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// TakeOver makes another holder take the lease name over, as a replica does
// after this one froze: it frees the lease whoever holds it and acquires it
// with a greater token. From then on the old holder's guarded writes are
// refused (fence.ErrFenced), and its lease ends at its next renewal or
// Check. It returns the new holder's lease (released when the test ends).
func (db *DB) TakeOver(tb TB, name string) *lock.Lease {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	thief := db.Client(tb, lock.Config{Holder: "pgfencetest-takeover"})
	if _, err := lock.ForceRelease(ctx, thief.Pool(), thief.Config().Schema, name); err != nil {
		tb.Fatalf("pgfencetest: take over %q: %v", name, err)
		return nil
	}
	l, err := thief.TryAcquire(ctx, name)
	if err != nil {
		tb.Fatalf("pgfencetest: take over %q: %v", name, err)
		return nil
	}
	return l
}

// Expire makes the database judge the lease expired now, without waiting
// for its TTL, and tells the holder at once (l.Check): l's context is
// cancelled with lock.ErrLeaseLost, and anyone can acquire the lease.
func (db *DB) Expire(tb TB, l *lock.Lease) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := db.Pool.Exec(ctx, expiry.SQL(db.Schema), l.Name())
	if err != nil {
		tb.Fatalf("pgfencetest: expire %q: %v", l.Name(), err)
		return
	}
	_ = l.Check(ctx) // reports the loss; the lease ends
}

// AssertUnderLease fails the test unless ctx belongs to a live lease named
// name (a lease's Context, an Election's Lead context, a runner job's), for
// code that must only run on the machine that holds it.
func AssertUnderLease(tb TB, ctx context.Context, name string) {
	tb.Helper()
	l, ok := lock.FromContext(ctx)
	switch {
	case !ok:
		tb.Errorf("pgfencetest: not running under a lease (want %q)", name)
	case l.Name() != name:
		tb.Errorf("pgfencetest: running under lease %q, want %q", l.Name(), name)
	case l.Err() != nil:
		tb.Errorf("pgfencetest: running under lease %q, which has ended: %v", name, l.Err())
	}
}

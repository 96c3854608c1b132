package lock_test

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// A wrong or missing schema is an error, not a retry loop.
// Acquire, TryAcquire and Election.Run against a schema that does not exist,
// one at an old version, or a role without privileges return at once with a
// typed error that says what to run (before the fix, Acquire logged a warning
// every poll and never returned).
func TestPermanentErrorsEndAcquire(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)

	missing := pgtest.Schema(t, "missing") // never created
	old := pgtest.Schema(t, "old")
	if _, err := db.Pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{old}.Sanitize()+"; CREATE TABLE "+
		pgx.Identifier{old, migrations.VersionTable}.Sanitize()+
		" (id serial, version_id bigint, is_applied boolean, tstamp timestamptz DEFAULT now()); INSERT INTO "+
		pgx.Identifier{old, migrations.VersionTable}.Sanitize()+" (version_id, is_applied) VALUES (0, true), (2, true)"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		schema string
		found  int64
	}{{missing, 0}, {old, 2}} {
		cl := newClient(t, db, lock.Config{Schema: c.schema, PollInterval: 10 * time.Millisecond})
		start := time.Now()
		_, err := cl.Acquire(ctx, "job")
		var nm *migrations.NotMigratedError
		if !errors.As(err, &nm) || nm.Found != c.found || !strings.Contains(err.Error(), "migrate up") {
			t.Fatalf("Acquire on schema %q: %v; want a NotMigratedError at version %d", c.schema, err, c.found)
		}
		if _, err := cl.TryAcquire(ctx, "job"); !errors.Is(err, migrations.ErrNotMigrated) {
			t.Fatalf("TryAcquire on schema %q: %v", c.schema, err)
		}
		e := &lock.Election{Client: cl, Name: "job", Lead: func(ctx context.Context, _ *lock.Lease) error { <-ctx.Done(); return nil }}
		if err := e.Run(ctx); !errors.Is(err, migrations.ErrNotMigrated) {
			t.Fatalf("Election.Run on schema %q: %v", c.schema, err)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Fatalf("took %v to give up", d)
		}
	}

	// A role without privileges on the schema: 42501, permanent.
	role := "pgfence_noperm_" + strings.ToLower(pgtest.UniqueName("r")[2:])
	if _, err := db.Pool.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.Pool.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role) })
	pool := pgtest.NewPool(t, "noperm", func(c *pgxpool.Config) { c.ConnConfig.User = role })
	cl, err := lock.New(pool, lock.Config{Schema: db.Schema, Logger: quiet, PollInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close(ctx)
	if _, err := cl.Acquire(ctx, "job"); err == nil || !strings.Contains(err.Error(), "42501") {
		t.Fatalf("Acquire without privileges: %v, want SQLSTATE 42501 at once", err)
	}
}

// Transient errors are retried with backoff and logged once per
// change of state, not once per poll.
func TestTransientErrorsLoggedOnce(t *testing.T) {
	t.Parallel()
	// A server that refuses connections: every attempt fails transiently.
	cfg, err := pgxpool.ParseConfig("postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	rec := pgtest.NewLogs()
	c, err := lock.New(pool, lock.Config{PollInterval: 10 * time.Millisecond, Logger: slog.New(rec)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if _, err := c.Acquire(ctx, "down"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Acquire against an unreachable server: %v, want the context's error", err)
	}
	warns, debugs := len(rec.Find(slog.LevelWarn, "")), len(rec.Find(slog.LevelDebug, ""))
	if warns != 1 || debugs < 3 {
		t.Fatalf("%d warnings and %d debug records for one failing state; want 1 warning and several retries", warns, debugs)
	}
}

// Configuration is checked before it reaches SQL.
func TestConfigChecks(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t, "config")
	for _, c := range []struct {
		cfg   lock.Config
		field string
	}{
		{lock.Config{Holder: "a\x00b"}, "Holder"},
		{lock.Config{TTL: math.MaxInt64, RenewInterval: math.MaxInt64/2 + 1}, "RenewInterval"},
		{lock.Config{PollInterval: time.Nanosecond}, "PollInterval"},
		{lock.Config{PollInterval: -time.Second}, "PollInterval"},
		{lock.Config{Schema: "a$body$b"}, "Schema"},
	} {
		_, err := lock.New(pool, c.cfg)
		var ce *lock.ConfigError
		if !errors.As(err, &ce) || ce.Field != c.field || !errors.Is(err, lock.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want a ConfigError for %s", c.cfg, err, c.field)
		}
	}
}

// `defer lease.Release(ctx)` works at shutdown, when ctx is
// already cancelled: the lease is freed at once, not after a TTL.
func TestReleaseWithCancelledContext(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	a := newClient(t, db, lock.Config{TTL: time.Minute})
	b := newClient(t, db, lock.Config{TTL: time.Minute})
	runCtx, stop := context.WithCancel(ctx)
	l, err := a.TryAcquire(runCtx, "shutdown")
	if err != nil {
		t.Fatal(err)
	}
	stop() // the service is stopping
	if err := l.Release(runCtx); err != nil {
		t.Fatalf("Release with a cancelled context: %v", err)
	}
	if _, err := b.TryAcquire(ctx, "shutdown"); err != nil {
		t.Fatalf("after Release with a cancelled context, the lease is still held: %v", err)
	}
}

// A cancelled acquisition leaves nothing behind. TryAcquire calls
// that give up on a deadline of 0-5 ms, some while their statement is in
// flight, must not leave leases held by nobody (before the fix, about one in
// ten did, each until its TTL ran out).
func TestCancelledAcquisitionsLeaveNothingHeld(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, 2*time.Minute)
	c, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, TTL: time.Hour, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	var failed, got int
	for i := range 300 {
		name := "n" + strings.Repeat("x", i%7) + string(rune('a'+i%26))
		dctx, cancel := context.WithTimeout(ctx, time.Duration(rand.Int64N(int64(5*time.Millisecond))))
		l, err := c.TryAcquire(dctx, name)
		cancel()
		switch {
		case err == nil:
			got++
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		case errors.Is(err, lock.ErrHeld):
			// an abandoned attempt not cleaned up yet holds it
		default:
			failed++
		}
	}
	if err := c.Close(ctx); err != nil { // waits for the background clean-ups
		t.Fatal(err)
	}
	var held int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{db.Schema, "pgfence_lease_states"}.Sanitize()+
		" WHERE holder IS NOT NULL AND expires_at > now()").Scan(&held); err != nil {
		t.Fatal(err)
	}
	t.Logf("300 TryAcquire calls on 0-5 ms deadlines: %d acquired, %d gave up", got, failed)
	if failed == 0 {
		t.Fatal("no call gave up mid-flight: the test did not exercise the case")
	}
	if held != 0 {
		t.Fatalf("%d leases left held by nobody after %d abandoned acquisitions", held, failed)
	}
}

// ForceRelease waits for open guarded transactions only as long
// as its context allows, and then names the sessions it waited for.
func TestForceReleaseBoundedAndNamesBlocker(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c := newClient(t, db, lock.Config{})
	l, err := c.TryAcquire(ctx, "busy")
	if err != nil {
		t.Fatal(err)
	}
	app := pgtest.UniqueName("guarded")
	gpool := pgtest.NewPool(t, app)
	tx, err := gpool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if err := l.Guard().Check(ctx, tx); err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	// Long enough for its statement to reach the row on a loaded machine
	// (at 300 ms it sometimes had not, and had no blocker to name).
	fctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err = lock.ForceRelease(fctx, c.Pool(), c.Config().Schema, "busy")
	var be *lock.BlockedError
	if !errors.As(err, &be) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("ForceRelease behind an open guarded transaction: %v, want a BlockedError", err)
	}
	// The blockers are looked up within 500 ms past the deadline: on a
	// loaded machine the look-up may not finish, and the error then says
	// why after the BlockedError (a race-enabled full run once named
	// none). When it says nothing more, it must name the blocker.
	lookupFailed := len(be.Backends) == 0 && err.Error() != be.Error()
	if lookupFailed {
		t.Logf("the blockers could not be looked up in time: %v", err)
	} else if len(be.Backends) != 1 || be.Backends[0].PID != pid || be.Backends[0].Application != app ||
		!strings.Contains(err.Error(), app) {
		t.Fatalf("BlockedError names %+v, want backend %d (%s)", be.Backends, pid, app)
	}
	if err := l.Err(); err != nil {
		t.Fatalf("a ForceRelease that gave up ended the lease: %v", err)
	}
	// If the server did not confirm the cancel within ForceRelease's
	// bound (a loaded machine), ForceRelease said so: its statement may
	// still free the lease once the transaction ends.
	mayStillFree := strings.Contains(err.Error(), "may still be freed")
	_ = tx.Rollback(ctx)
	freed, err := lock.ForceRelease(ctx, c.Pool(), c.Config().Schema, "busy")
	if err != nil || freed.Holder != l.Holder() && !(freed.Holder == "" && mayStillFree) {
		t.Fatalf("ForceRelease after the transaction ended: %q, %v (the first said it may still free it: %v)", freed.Holder, err, mayStillFree)
	}
}

// One errors.Is target for "no longer the holder", and 10.13:
// one token type and one error prefix per package.
func TestOneTargetForFenced(t *testing.T) {
	t.Parallel()
	if !errors.Is(lock.ErrLeaseLost, fence.ErrFenced) || !errors.Is(&fence.StaleTokenError{}, fence.ErrFenced) {
		t.Fatal("ErrLeaseLost and StaleTokenError must match fence.ErrFenced")
	}
	if errors.Is(lock.ErrHeld, fence.ErrFenced) || errors.Is(lock.ErrReleased, fence.ErrFenced) {
		t.Fatal("ErrHeld and ErrReleased are not fenced")
	}
	var tok fence.Token = (&lock.HeldError{Token: 7}).Token // compile-time: one token type
	if tok != 7 || !strings.HasPrefix(fence.ErrInvalidName.Error(), "fence: ") {
		t.Fatalf("token %d, ErrInvalidName %q", tok, fence.ErrInvalidName)
	}
}

// Renewals never starve behind the pool's other users. Every
// pooled connection is held (by jobs, guarded transactions, waiting
// acquirers) for longer than a TTL (four renewals, waited for): the lease is
// still renewed and stays live (formerly the renewal waited for a pooled
// connection and the lease was lost). A 3 s TTL leaves a loaded machine
// two seconds of slack per renewal.
func TestRenewalsDoNotStarve(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	pool := pgtest.NewPool(t, "starve", func(c *pgxpool.Config) { c.MaxConns = 2 })
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, TTL: 3 * time.Second, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	l, err := c.TryAcquire(ctx, "busy-pool")
	if err != nil {
		t.Fatal(err)
	}
	var held []*pgxpool.Conn
	for range 2 {
		pc, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, pc)
	}
	before := c.Stats().Renewals
	pgtest.Eventually(t, 40*time.Second, "four renewals with the pool busy", func() bool {
		return c.Stats().Renewals-before >= 4 || l.Err() != nil
	})
	if err := l.Err(); err != nil {
		t.Fatalf("lease lost while the pool was busy: %v", err)
	}
	for _, pc := range held {
		pc.Release()
	}
}

// A round trip is not clock skew: with the database on this machine's clock,
// even a 1ns SkewWarning never warns, however slow the renewals' round trips
// are (formerly a round trip's half was read as skew: 47 warnings in 6
// minutes on a loaded machine at the default threshold), and the estimate
// stays within half a round trip of zero. The warning's crossings are
// checked with skewed clocks in TestSkewWarningOnCrossings.
func TestRoundTripIsNotSkew(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	rec := pgtest.NewLogs()
	c := newClient(t, db, lock.Config{TTL: 3 * time.Second, SkewWarning: time.Nanosecond, Logger: slog.New(rec)})
	if _, err := c.TryAcquire(ctx, "skewed"); err != nil {
		t.Fatal(err)
	}
	// Several renewals (every second): waited for, not slept for, so that a
	// loaded machine only makes the test slower.
	pgtest.Eventually(t, 30*time.Second, "three renewals", func() bool { return c.Stats().Renewals >= 3 })
	if n := len(rec.Find(slog.LevelWarn, "SkewWarning")); n != 0 {
		t.Fatalf("%d skew warnings with the database on this machine's clock, want none", n)
	}
	st := c.Stats()
	if st.ClockSkew > st.LastRenewLatency/2+time.Millisecond || -st.ClockSkew > st.LastRenewLatency/2+time.Millisecond {
		t.Fatalf("skew estimate %v outside half the round trip (%v) of zero", st.ClockSkew, st.LastRenewLatency)
	}
}

// Connection churn: blocked acquirers share the client's one
// listening connection, and it is kept for a while after the last waiter, so
// a stream of handovers does not open a server connection each (formerly,
// 250 handovers opened 251).
func TestHandoversDoNotChurnConnections(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	holder := newClient(t, db, lock.Config{})
	pool := pgtest.NewPool(t, "churn")
	waiter, err := lock.New(pool, lock.Config{Schema: db.Schema, PollInterval: 10 * time.Second, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer waiter.Close(ctx)
	leases := pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()
	handover := func() {
		l, err := holder.TryAcquire(ctx, "busy")
		if err != nil {
			t.Fatal(err)
		}
		// The waiter's poller marks the row (waiters_until) once the
		// waiter listens: cleared here, the mark says this waiter waits.
		if _, err := db.Pool.Exec(ctx, "UPDATE "+leases+" SET waiters_until = NULL WHERE name = 'busy'"); err != nil {
			t.Fatal(err)
		}
		got := make(chan error, 1)
		go func() {
			wl, err := waiter.Acquire(ctx, "busy") // blocks until the release
			if err == nil {
				err = wl.Release(ctx)
			}
			got <- err
		}()
		pgtest.Eventually(t, 30*time.Second, "the waiter to wait, listening", func() bool {
			var marked bool
			_ = db.Pool.QueryRow(ctx, "SELECT waiters_until IS NOT NULL FROM "+leases+" WHERE name = 'busy'").Scan(&marked)
			return marked
		})
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-got; err != nil {
			t.Fatal(err)
		}
	}
	handover() // warm: the pool and the listening connection exist
	before := pool.Stat().NewConnsCount()
	for range 30 {
		handover()
	}
	if opened := pool.Stat().NewConnsCount() - before; opened > 3 {
		t.Fatalf("30 handovers opened %d new connections, want the listening connection kept", opened)
	}
}

// Acquire against a server that refuses connections, until its deadline:
// the error is the deadline's (errors.Is), and it names the failure that
// kept Acquire from the lease instead of a bare "context deadline
// exceeded".
func TestAcquireDeadlineNamesTheLastFailure(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().(*net.TCPAddr)
	ln.Close() // nothing listens there now: connections are refused
	cfg := db.Pool.Config().Copy()
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(addr.Port)
	cfg.ConnConfig.Fallbacks = nil
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = c.Acquire(ctx, "unreachable")
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("Acquire at its deadline: %v; want the deadline, naming the refused connection", err)
	}
	t.Logf("Acquire at its deadline: %v", err)

	// Waiting for a holder is not a failure: the deadline alone.
	held := newClient(t, db, lock.Config{})
	if _, err := held.TryAcquire(context.Background(), "busy"); err != nil {
		t.Fatal(err)
	}
	waiter := newClient(t, db, lock.Config{})
	wctx, wcancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer wcancel()
	if _, err := waiter.Acquire(wctx, "busy"); err != context.DeadlineExceeded {
		t.Fatalf("Acquire of a held lease at its deadline: %v, want context.DeadlineExceeded itself", err)
	}
}

// Renewals slower than half of RenewInterval are counted and warned of,
// once, and their end is noted, once. The renewal is slowed for real: a
// transaction holds the client's session row lock, so the renewal's UPDATE
// waits.
func TestSlowRenewalsWarnOnce(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	rec := pgtest.NewLogs()
	c := newClient(t, db, lock.Config{TTL: 8 * time.Second, RenewInterval: time.Second, Logger: slog.New(rec)})
	l, err := c.TryAcquire(ctx, "slowed")
	if err != nil {
		t.Fatal(err)
	}
	warnings := func() int { return len(rec.Find(slog.LevelWarn, "renewals take more")) }
	notes := func() int { return len(rec.Find(slog.LevelInfo, "renewals fast again")) }
	// The counts from here on: from a fast renewal, once any slow period
	// that a loaded machine caused has ended.
	pgtest.Eventually(t, 30*time.Second, "a fast renewal, no slow period open", func() bool {
		st := c.Stats()
		return st.Renewals >= 1 && st.LastRenewLatency < 500*time.Millisecond && warnings() == notes()
	})
	slow0, warn0, note0 := c.Stats().SlowRenewals, warnings(), notes()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := tx.QueryRow(ctx, "SELECT pg_backend_pid() FROM "+db.Schema+".pgfence_sessions WHERE id = "+
		"(SELECT session FROM "+db.Schema+".pgfence_leases WHERE name = 'slowed') FOR UPDATE").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	// The renewal waits for the row lock; it is held two seconds more
	// (four times the slow threshold; a loaded machine only adds to it).
	pgtest.Eventually(t, 30*time.Second, "the renewal to wait for the row lock", func() bool {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, pid).Scan(&n)
		return n > 0
	})
	time.Sleep(2 * time.Second)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, 30*time.Second, "the slow renewal counted", func() bool { return c.Stats().SlowRenewals >= slow0+1 })
	r0 := c.Stats().Renewals
	pgtest.Eventually(t, 30*time.Second, "renewals fast again", func() bool {
		return notes() == note0+1 && c.Stats().Renewals >= r0+2
	})
	if n := warnings() - warn0; n != 1 {
		t.Fatalf("%d warnings of slow renewals for one slow period, want 1", n)
	}
	if err := l.Check(ctx); err != nil {
		t.Fatalf("the lease after a slow renewal (within its TTL): %v", err)
	}
}

// A Close that comes while another Close is releasing the client's leases
// returns by its own deadline when the server stops answering (a partition
// that black-holes packets), not when the first gives up.
func TestCloseReturnsByItsDeadlineWhileAnotherCloses(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	proxy, err := faultproxy.To(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.NewPool(t, pgtest.UniqueName("close-cut"), func(c *pgxpool.Config) { proxy.Route(&c.ConnConfig.Config) })
	// Registered after the pool's, so it runs first: the pool closes its
	// cut connections at once.
	t.Cleanup(func() { _ = proxy.Close() })
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.TryAcquire(ctx, "held"); err != nil {
		t.Fatal(err)
	}
	proxy.Set(faultproxy.Blackhole)
	first := make(chan error, 1)
	go func() { first <- c.Close(context.Background()) }() // its release waits up to wait.CleanupTimeout
	pgtest.Eventually(t, 30*time.Second, "the first Close under way", func() bool {
		hctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
		defer cancel()
		return errors.Is(c.Health(hctx), lock.ErrClosed)
	})
	deadline := time.Now().Add(300 * time.Millisecond)
	cctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	err = c.Close(cctx)
	late := time.Since(deadline)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the second Close: %v, want its context's error", err)
	}
	if late > wait.PastDeadline+time.Second {
		t.Fatalf("the second Close returned %v past its deadline while the first released", late)
	}
	select {
	case <-first:
	case <-time.After(30 * time.Second):
		t.Fatal("the first Close did not return within 30 s")
	}
}

// An acquisition that the server ran but whose reply the client never got
// (the connection reset after the reply was sent) may have been granted:
// TryAcquire reports the failure and frees the lease in the background, in
// either protocol mode. pgx reports the reset of a simple-protocol
// statement as a request never sent (pgconn.SafeToRetry), which is not
// proof that the server did not run it.
func TestTryAcquireWhoseReplyWasLostFreesTheLease(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ctx := ctxT(t, 2*time.Minute)
			proxy, err := faultproxy.To(db.URL)
			if err != nil {
				t.Fatal(err)
			}
			// An acquisition's compare-and-set commits as it runs.
			proxy.CommitsOn(func(q string) bool { return strings.Contains(q, "SET token = DEFAULT, holder = ") })
			var armed atomic.Bool
			proxy.OnCommit(func() (faultproxy.CommitFault, time.Duration) {
				if armed.CompareAndSwap(true, false) {
					return faultproxy.ResetAfterReply, 0
				}
				return faultproxy.CommitPass, 0
			})
			pool := pgtest.NewPool(t, pgtest.UniqueName("lost-reply"), func(c *pgxpool.Config) {
				proxy.Route(&c.ConnConfig.Config)
				c.ConnConfig.DefaultQueryExecMode = mode
			})
			t.Cleanup(func() { _ = proxy.Close() })
			other := db.Client(t, lock.Config{Schema: db.Schema, Logger: quiet})
			l, err := other.TryAcquire(ctx, "job") // the row exists: the next acquisition is an update
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			// A lease held meanwhile keeps the client's session renewed:
			// a lease its session names does not expire by itself.
			c, err := lock.New(pool, lock.Config{Schema: db.Schema, TTL: 3 * time.Second, Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = c.Close(context.Background()) })
			if _, err := c.TryAcquire(ctx, "held"); err != nil {
				t.Fatal(err)
			}
			armed.Store(true)
			if l, err := c.TryAcquire(ctx, "job"); err == nil {
				t.Fatalf("TryAcquire whose reply was lost returned lease %v, want its error", l.Token())
			}
			if n := proxy.Commits()[faultproxy.ResetAfterReply]; n != 1 {
				t.Fatalf("%d acquisitions had their reply lost, want 1", n)
			}
			// Unless freed already (it is, within wait.CleanupTimeout),
			// the lease is the client's: the acquisition was granted.
			if i, err := lock.Inspect(ctx, db.Pool, db.Schema, "job"); err != nil || i.Held && i.Holder != c.Config().Holder {
				t.Fatalf("the lease after its acquisition's reply was lost: %+v, %v; want it free or the client's", i, err)
			}
			var granted bool
			if err := db.Pool.QueryRow(ctx, "SELECT token > $1 FROM "+pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()+
				" WHERE name = 'job'", int64(l.Token())).Scan(&granted); err != nil || !granted {
				t.Fatalf("the lease's token after the lost reply: granted %v, %v; want a new token", granted, err)
			}
			// Freed within wait.CleanupTimeout; the session (TTL 3 s) would
			// keep it for as long as the client lives.
			pgtest.Eventually(t, 20*time.Second, "another client to acquire the lease whose acquisition reply was lost", func() bool {
				l, err := other.TryAcquire(ctx, "job")
				if err == nil {
					_ = l.Release(ctx)
				}
				return err == nil
			})
		})
	}
}

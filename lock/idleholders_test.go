package lock_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
)

// An acquisition that waits on the row of an expired lease ends the session
// of a transaction idle there (a holder frozen inside a guarded
// transaction), and the acquisition goes on, also when the row has moved
// since it began to wait. It ends nothing else: not a guarded transaction
// running a statement (the acquisition waits for it), not an idle
// transaction that blocks a statement on another table's row at the same
// position, not one that holds a lock on the whole table, and not an idle
// guarded transaction of a lease that has not expired (ForceRelease waits
// for it until its context ends). Each check waits for the watcher to have
// looked at least twice, so that a looser rule would be caught.
func TestTakeoverEndsOnlyIdleHolders(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, 2*time.Minute)
	holder := newClient(t, db, lock.Config{})
	taker := newClient(t, db, lock.Config{})
	pool := pgtest.NewPool(t, pgtest.UniqueName("sessions"), func(c *pgxpool.Config) { c.MaxConns = 8 })
	leases := pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()
	begin := func() pgx.Tx {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		return tx
	}
	// guarded opens a transaction that has checked a new lease's token, and
	// leaves it idle.
	guarded := func(name string) (*lock.Lease, pgx.Tx) {
		t.Helper()
		l, err := holder.TryAcquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		tx := begin()
		if err := l.Guard().Check(ctx, tx); err != nil {
			t.Fatal(err)
		}
		return l, tx
	}
	alive := func(tx pgx.Tx) bool {
		_, err := tx.Exec(ctx, "SELECT 1")
		return err == nil
	}
	// looks waits until the taker's acquisition of name has looked n
	// more times for idle holders, none failing: n+1 begun, since one
	// acquisition's looks run one after the other.
	looks := func(name string, n uint64) {
		t.Helper()
		from := taker.Stats()
		pgtest.Eventually(t, time.Minute, fmt.Sprintf("%d looks for idle holders of %s", n, name), func() bool {
			return taker.Stats().IdleHolderLooks >= from.IdleHolderLooks+n+1
		})
		if failed := taker.Stats().IdleHolderLookErrors - from.IdleHolderLookErrors; failed > 0 {
			t.Fatalf("%d looks for idle holders of %s failed", failed, name)
		}
	}
	type result struct {
		l   *lock.Lease
		err error
	}
	acquire := func(name string) <-chan result {
		got := make(chan result, 1)
		go func() {
			l, err := taker.TryAcquire(ctx, name)
			got <- result{l, err}
		}()
		return got
	}

	// A lease that has not expired: ForceRelease waits for its idle
	// guarded transaction and leaves it alone.
	liveName := pgtest.UniqueName("live")
	_, live := guarded(liveName)
	fctx, cancel := context.WithCancel(ctx)
	forced := make(chan error, 1)
	var forceLooks atomic.Uint64 // ForceRelease's looks that succeeded
	go func() {
		_, err := lock.ForceReleaseLooking(fctx, taker.Pool(), taker.Config().Schema, liveName, &forceLooks)
		forced <- err
	}()
	pgtest.Eventually(t, time.Minute, "two looks for idle holders of the live lease, or ForceRelease returning", func() bool {
		return forceLooks.Load() >= 2 || len(forced) > 0
	})
	cancel()
	var be *lock.BlockedError
	if err := <-forced; !errors.As(err, &be) {
		t.Fatalf("ForceRelease of a live lease behind an idle guarded transaction: %v, want a BlockedError", err)
	}
	if !alive(live) {
		t.Fatal("ForceRelease ended the idle guarded transaction of a lease that had not expired")
	}

	// An expired lease whose guarded transaction runs a statement (here
	// one waiting for a lock the test holds): the acquisition waits for it.
	busyName := pgtest.UniqueName("busy")
	_, busy := guarded(busyName)
	key := time.Now().UnixNano()
	gate := begin()
	if _, err := gate.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", key); err != nil {
		t.Fatal(err)
	}
	var busyPID int
	if err := busy.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&busyPID); err != nil {
		t.Fatal(err)
	}
	expire(t, db, busyName)
	type stmt struct {
		at  time.Time // server time when the statement ended
		err error
	}
	ran := make(chan stmt, 1)
	go func() {
		var s stmt
		s.err = busy.QueryRow(ctx, "SELECT clock_timestamp() FROM pg_advisory_lock($1)", key).Scan(&s.at)
		ran <- s
	}()
	pgtest.Eventually(t, time.Minute, "the guarded statement waiting for the test's lock", func() bool {
		var waiting bool
		err := db.Pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock')", busyPID).Scan(&waiting)
		return err == nil && waiting
	})
	got := acquire(busyName)
	looks(busyName, 2)
	if err := gate.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	s := <-ran
	if s.err != nil {
		t.Fatalf("the running guarded statement (backend %d) failed: %v", busyPID, s.err)
	}
	if r := <-got; r.err != nil {
		t.Fatal(r.err)
	}
	var acquiredAt time.Time
	if err := db.Pool.QueryRow(ctx, "SELECT acquired_at FROM "+leases+" WHERE name = $1", busyName).Scan(&acquiredAt); err != nil {
		t.Fatal(err)
	}
	if acquiredAt.Before(s.at) {
		t.Fatalf("acquired at %v, before the running guarded statement ended at %v", acquiredAt, s.at)
	}
	// Once the statement is done, the transaction idles on the row, and
	// the acquisition may have ended it then; either way it is over.
	_ = busy.Rollback(ctx)

	// An expired lease whose guarded transaction sits idle (its holder
	// frozen): the acquisition ends that session and goes on. Beside it, an
	// idle transaction blocks a statement on another table's row at the
	// lease row's position: it is not ended.
	frozenName := pgtest.UniqueName("frozen")
	frozen, idle := guarded(frozenName)
	expire(t, db, frozenName)
	var page, offset int
	if err := db.Pool.QueryRow(ctx, "SELECT (ctid::text::point)[0]::int, (ctid::text::point)[1]::int FROM "+leases+
		" WHERE name = $1", frozenName).Scan(&page, &offset); err != nil {
		t.Fatal(err)
	}
	other := pgx.Identifier{db.Schema, "other"}.Sanitize()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+other+" (id int PRIMARY KEY, pad text)"); err != nil {
		t.Fatal(err)
	}
	// Rows until one sits at (page, offset).
	var at string
	for id := 1; at != fmt.Sprintf("(%d,%d)", page, offset); id++ {
		if id > 10000 {
			t.Fatalf("no row of the other table landed at (%d,%d)", page, offset)
		}
		if err := db.Pool.QueryRow(ctx, "INSERT INTO "+other+" VALUES ($1, repeat('x', 200)) RETURNING ctid::text", id).Scan(&at); err != nil {
			t.Fatal(err)
		}
	}
	unrelated := begin()
	var unrelatedPID int
	if err := unrelated.QueryRow(ctx, "SELECT pg_backend_pid() FROM "+other+" WHERE ctid = $1::tid FOR UPDATE", at).Scan(&unrelatedPID); err != nil {
		t.Fatal(err)
	}
	blocked := make(chan error, 1)
	go func() {
		_, err := pool.Exec(ctx, "UPDATE "+other+" SET pad = 'y' WHERE ctid = $1::tid", at)
		blocked <- err
	}()
	pgtest.Eventually(t, time.Minute, "the other table's statement waiting, its blocker idle for longer than a look needs", func() bool {
		var ready bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'tuple' AND relation = $1::regclass)
		   AND EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $2 AND state = 'idle in transaction'
		               AND state_change < now() - interval '500 milliseconds')`, other, unrelatedPID).Scan(&ready)
		return err == nil && ready
	})
	ended := taker.Stats().IdleHoldersEnded
	if r := <-acquire(frozenName); r.err != nil || r.l.Token() <= frozen.Token() {
		t.Fatalf("takeover behind an idle holder: %v (token %v, the frozen holder's %d)", r.err, r.l, frozen.Token())
	}
	if alive(idle) {
		t.Fatal("the idle guarded transaction of the expired lease is still alive after the takeover")
	}
	if n := taker.Stats().IdleHoldersEnded - ended; n != 1 {
		t.Fatalf("IdleHoldersEnded grew by %d, want 1", n)
	}
	_ = idle.Rollback(ctx) // its connection back to the pool

	// The same, with the lease row moved after the acquisition began to
	// wait and before the first look: an update that leaves the key alone
	// does not wait, and the acquisition waits on the version it found.
	// On a machine so slow that a look came first, the round says nothing
	// about the moved row, and runs again.
	for round := 1; ; round++ {
		movedName := pgtest.UniqueName("moved")
		_, idle := guarded(movedName)
		expire(t, db, movedName)
		before := taker.Stats().IdleHolderLooks
		got = acquire(movedName)
		pgtest.Eventually(t, time.Minute, "the acquisition waiting on the lease row", func() bool {
			var waiting bool
			err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'tuple' AND relation = $1::regclass)`, leases).Scan(&waiting)
			return err == nil && waiting
		})
		if _, err := db.Pool.Exec(ctx, "UPDATE "+leases+" SET observers_until = now() WHERE name = $1", movedName); err != nil {
			t.Fatal(err)
		}
		early := taker.Stats().IdleHolderLooks - before
		if r := <-got; r.err != nil {
			t.Fatal(r.err)
		}
		if alive(idle) {
			t.Fatal("the idle guarded transaction of the moved lease row is still alive after the takeover")
		}
		_ = idle.Rollback(ctx)
		if early == 0 {
			break
		}
		if round == 5 {
			t.Fatal("in 5 rounds a look for idle holders always began before the lease row moved")
		}
		t.Logf("round %d: a look began before the lease row moved; again", round)
	}

	// An idle transaction that holds a lock on the whole table (an open
	// migration, an operator in psql) is not ended, though the acquisition
	// waits for it: what it holds is not the row.
	lockedName := pgtest.UniqueName("locked")
	if _, err := holder.TryAcquire(ctx, lockedName); err != nil {
		t.Fatal(err)
	}
	expire(t, db, lockedName)
	tableLock := begin()
	if _, err := tableLock.Exec(ctx, "LOCK TABLE "+leases+" IN SHARE MODE; SELECT pg_current_xact_id()"); err != nil {
		t.Fatal(err)
	}
	got = acquire(lockedName)
	looks(lockedName, 2)
	if !alive(tableLock) {
		t.Fatal("the acquisition ended a transaction that held a lock on the table, not on the row")
	}
	if err := tableLock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if r := <-got; r.err != nil {
		t.Fatal(r.err)
	}

	// Nothing else was ended, and the unrelated statement still waits.
	if !alive(live) || !alive(unrelated) {
		t.Fatalf("sessions ended that did not block a takeover: live lease's %v, unrelated %v", alive(live), alive(unrelated))
	}
	select {
	case err := <-blocked:
		t.Fatalf("the unrelated blocked statement ended (%v) while its blocker was open", err)
	default:
	}
	if err := unrelated.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-blocked; err != nil {
		t.Fatal(err)
	}
}

// A client whose acquisitions keep waiting briefly on a lease row (another
// statement holds it for a moment, as contention does) opens the
// connection it looks for idle holders on once, and keeps it: a look cut
// short when the acquisition goes through must not cut short the connect
// it started. Otherwise every short wait dials the server again (here, 8
// connections for 8 waits) and a contended lease turns into a storm of
// connection attempts, which on a busy server overflow its listen queue
// and hold up every client's connects, renewers' included. The connects
// are slowed to a second here, as a loaded server slows them, and each
// wait ends once a look has begun, while its connect is in flight.
func TestIdleHolderLooksKeepTheirConnection(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, 2*time.Minute)
	var connects atomic.Int64
	pool := pgtest.NewPool(t, pgtest.UniqueName("looker"), func(c *pgxpool.Config) {
		c.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error {
			connects.Add(1)
			select {
			case <-time.After(time.Second):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	})
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, TTL: time.Minute, IdleHolderAfter: 20 * time.Millisecond, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	l, err := c.TryAcquire(ctx, "contended") // the row exists, the pool is warm
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// The blocker holds the lease row in one statement that waits for an
	// advisory lock the gate holds (a running statement, which no look
	// ends); the gate lets it go once the acquisition has waited long
	// enough for a look to begin, so each wait ends while that look's
	// connect is in flight.
	blocker := pgtest.NewPool(t, pgtest.UniqueName("blocker"))
	gate, err := pgtest.NewPool(t, pgtest.UniqueName("gate"), func(c *pgxpool.Config) { c.MaxConns = 1 }).Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer gate.Release()
	leases := pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()
	const key = 4_510_001
	const waits = 8
	own0, looks0 := connects.Load()-int64(pool.Stat().NewConnsCount()), c.Stats().IdleHolderLooks
	for range waits {
		if _, err := gate.Exec(ctx, "SELECT pg_advisory_lock($1)", key); err != nil {
			t.Fatal(err)
		}
		held := make(chan error, 1)
		go func() {
			_, err := blocker.Exec(ctx, "WITH held AS (SELECT name FROM "+leases+" WHERE name = 'contended' FOR UPDATE) "+
				"SELECT pg_advisory_xact_lock($1) FROM held", key)
			held <- err
		}()
		pgtest.Eventually(t, 30*time.Second, "the blocker to hold the row", func() bool {
			var n int
			_ = db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND query LIKE '%'||$1||'%'", db.Schema).Scan(&n)
			return n > 0
		})
		looked := c.Stats().IdleHolderLooks
		opened := make(chan error, 1)
		go func() {
			for deadline := time.Now().Add(30 * time.Second); c.Stats().IdleHolderLooks == looked; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(deadline) {
					opened <- errors.New("no look began while the acquisition waited on the row for 30 s")
					return
				}
			}
			_, err := gate.Exec(ctx, "SELECT pg_advisory_unlock($1)", key)
			opened <- err
		}()
		l, err := c.TryAcquire(ctx, "contended")
		if err != nil {
			t.Fatal(err)
		}
		if err := <-opened; err != nil {
			t.Fatal(err)
		}
		if err := <-held; err != nil {
			t.Fatalf("the blocking statement: %v", err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	own := connects.Load() - int64(pool.Stat().NewConnsCount()) - own0
	looks := c.Stats().IdleHolderLooks - looks0
	t.Logf("%d waits: %d looks for idle holders, %d connects outside the pool", waits, looks, own)
	if looks < waits {
		t.Fatalf("%d looks for %d waits on the row: the waits did not start the watcher, so the count of connects says nothing", looks, waits)
	}
	// One for the looker, one for the renewer, which may connect meanwhile,
	// and one spare (a pool's connect in flight is counted before the
	// pool counts it).
	if own > 3 {
		t.Fatalf("%d connects outside the pool for %d short waits on the row: the looker's connection was not kept", own, waits)
	}
}

// cutBeforeEnding is a connection whose network the proxy cuts (black
// hole) just before the look sends its pg_terminate_backend.
type cutBeforeEnding struct {
	*pgx.Conn
	proxy *faultproxy.Proxy
	cut   atomic.Bool
}

func (c *cutBeforeEnding) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if strings.Contains(sql, "pg_terminate_backend") {
		c.cut.Store(true)
		c.proxy.Set(faultproxy.Blackhole)
	}
	return c.Conn.QueryRow(ctx, sql, args...)
}

// A look that found an idle holder returns within wait.PastDeadline of its
// caller's deadline even when the server stops answering just as it sends
// the ending (an acquisition and ForceRelease wait for their look before
// they return).
func TestIdleHolderLookReturnsByItsDeadline(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	holder := newClient(t, db, lock.Config{})
	pool := pgtest.NewPool(t, pgtest.UniqueName("idle-cut"), func(c *pgxpool.Config) { c.MaxConns = 4 })
	name := pgtest.UniqueName("cut")
	l, err := holder.TryAcquire(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	// The holder's guarded transaction sits idle on the row; the lease
	// expires; a statement then waits on the row, as a takeover does.
	idle, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = idle.Rollback(context.Background()) })
	if err := l.Guard().Check(ctx, idle); err != nil {
		t.Fatal(err)
	}
	expire(t, db, name)
	waiting, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// At the end the idle holder goes first; the waiting statement then
	// returns, and only then is its transaction ended (one goroutine at
	// a time on its connection).
	waited := make(chan struct{})
	t.Cleanup(func() {
		<-waited
		_ = waiting.Rollback(context.Background())
	})
	t.Cleanup(func() { _ = idle.Rollback(context.Background()) })
	var waiter int64
	if err := waiting.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&waiter); err != nil {
		close(waited)
		t.Fatal(err)
	}
	leases := pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()
	go func() {
		defer close(waited)
		_, _ = waiting.Exec(ctx, "SELECT 1 FROM "+leases+" WHERE name = $1 FOR UPDATE", name)
	}()
	pgtest.Eventually(t, 30*time.Second, "the statement waiting on the row", func() bool {
		var blocked bool
		_ = db.Pool.QueryRow(ctx, "SELECT cardinality(pg_blocking_pids($1)) > 0", waiter).Scan(&blocked)
		return blocked
	})

	proxy, err := faultproxy.To(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	cfg, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy.Route(&cfg.Config)
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	looker := &cutBeforeEnding{Conn: conn, proxy: proxy}
	deadline := time.Now().Add(2 * time.Second)
	lctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	_, err = lock.EndIdleHolders(lctx, looker, db.Schema, name, time.Millisecond, waiter)
	late := time.Since(deadline)
	if !looker.cut.Load() {
		t.Fatalf("the look did not try to end the idle holder (err %v): nothing was cut", err)
	}
	if err == nil {
		t.Fatal("the look reports no error although its ending got no answer")
	}
	if late > wait.PastDeadline+time.Second {
		t.Fatalf("the look returned %v past its deadline (allowed: wait.PastDeadline, %v, and 1 s for a loaded machine): %v", late, wait.PastDeadline, err)
	}
	t.Logf("returned %v past the deadline: %v", late.Round(time.Millisecond), err)
}

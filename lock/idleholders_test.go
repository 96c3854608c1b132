package lock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// An acquisition that waits on the row of an expired lease ends the session
// of a transaction idle there (a holder frozen inside a guarded
// transaction), and the acquisition goes on. It ends nothing else: not a
// guarded transaction running a statement (the acquisition waits for it),
// not an idle transaction that blocks some other statement, and not an idle
// guarded transaction of a lease that has not expired (ForceRelease waits
// for it until its context ends). Each of these would be ended by a looser
// rule, which this test would catch.
func TestTakeoverEndsOnlyIdleHolders(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	holder := newClient(t, db, lock.Config{})
	taker := newClient(t, db, lock.Config{})
	pool := pgtest.NewPool(t, pgtest.UniqueName("sessions"))
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

	// An idle transaction that blocks a statement on another table.
	other := pgx.Identifier{db.Schema, "other"}.Sanitize()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+other+" (id int PRIMARY KEY); INSERT INTO "+other+" VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	unrelated := begin()
	if _, err := unrelated.Exec(ctx, "SELECT id FROM "+other+" WHERE id = 1 FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	blocked := make(chan error, 1)
	go func() {
		_, err := pool.Exec(ctx, "UPDATE "+other+" SET id = id WHERE id = 1")
		blocked <- err
	}()

	// A lease that has not expired: ForceRelease waits for its idle
	// guarded transaction, for four looks, and leaves it alone.
	_, live := guarded("live")
	fctx, cancel := context.WithTimeout(ctx, time.Second)
	_, _, err := lock.ForceRelease(fctx, taker.Pool(), taker.Config().Schema, "live")
	cancel()
	var be *lock.BlockedError
	if !errors.As(err, &be) {
		t.Fatalf("ForceRelease of a live lease behind an idle guarded transaction: %v, want a BlockedError", err)
	}
	if !alive(live) {
		t.Fatal("ForceRelease ended the idle guarded transaction of a lease that had not expired")
	}

	// An expired lease whose guarded transaction runs a statement: the
	// acquisition waits for it.
	_, busy := guarded("busy")
	expire(t, db, "busy")
	slept := make(chan time.Time, 1)
	go func() {
		if _, err := busy.Exec(ctx, "SELECT pg_sleep(1)"); err != nil {
			t.Errorf("the running guarded statement failed: %v", err)
		}
		slept <- time.Now()
	}()
	pgtest.Eventually(t, 10*time.Second, "the guarded statement running", func() bool {
		var running bool
		err := db.Pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query = 'SELECT pg_sleep(1)')").Scan(&running)
		return err == nil && running
	})
	if _, err := taker.TryAcquire(ctx, "busy"); err != nil {
		t.Fatal(err)
	}
	acquired := time.Now()
	if end := <-slept; acquired.Before(end) {
		t.Fatalf("the acquisition returned %v before the running guarded statement did", end.Sub(acquired))
	}
	// Once the statement is done, the transaction idles on the row, and
	// the acquisition may have ended it then; either way it is over.
	_ = busy.Rollback(ctx)

	// An expired lease whose guarded transaction sits idle (its holder
	// frozen): the acquisition ends that session and goes on.
	frozen, idle := guarded("frozen")
	expire(t, db, "frozen")
	ended := taker.Stats().IdleHoldersEnded
	l, err := taker.TryAcquire(ctx, "frozen")
	if err != nil {
		t.Fatal(err)
	}
	if l.Token() <= frozen.Token() {
		t.Fatalf("new token %d, frozen holder's %d", l.Token(), frozen.Token())
	}
	if alive(idle) {
		t.Fatal("the idle guarded transaction of the expired lease is still alive after the takeover")
	}
	if n := taker.Stats().IdleHoldersEnded - ended; n != 1 {
		t.Fatalf("IdleHoldersEnded grew by %d, want 1", n)
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

package fence_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// The seed scenario. A writes with n; A's lease expires; B
// acquires n+1 and writes; A's write with n is refused and leaves nothing.
func TestStaleLeaderIsRefused(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	charges := table(db, "charges")
	mustExec(t, db, "CREATE TABLE "+charges+" (who text, token bigint)")
	a := newClient(t, db, lock.Config{Holder: "A"})
	b := newClient(t, db, lock.Config{Holder: "B"})

	la, err := a.TryAcquire(ctx, "billing")
	if err != nil {
		t.Fatal(err)
	}
	n := la.Token()
	ga := la.Guard() // A keeps its guard, as a paused process keeps its state
	write := func(g fence.Guard, who string) error {
		return g.RunTx(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+charges+" VALUES ($1, $2)", who, int64(g.Token))
			return err
		})
	}
	if err := write(ga, "A"); err != nil {
		t.Fatalf("A's first write: %v", err)
	}
	expire(t, db, "billing")
	lb, err := b.TryAcquire(ctx, "billing")
	if err != nil {
		t.Fatal(err)
	}
	if lb.Token() != n+1 {
		t.Fatalf("B's token = %d, want %d", lb.Token(), n+1)
	}
	if err := write(lb.Guard(), "B"); err != nil {
		t.Fatalf("B's write: %v", err)
	}
	err = write(ga, "A")
	var stale *fence.StaleTokenError
	if !errors.As(err, &stale) || !errors.Is(err, fence.ErrStaleToken) {
		t.Fatalf("A's stale write: err = %v, want *StaleTokenError", err)
	}
	if stale.Presented != n || stale.Current != n+1 || stale.Lease != "billing" {
		t.Fatalf("StaleTokenError = %+v", stale)
	}
	if got := rows(t, db, "SELECT who || ':' || token FROM "+charges+" ORDER BY token"); fmt.Sprint(got) != fmt.Sprintf("[A:%d B:%d]", n, n+1) {
		t.Fatalf("charges = %v", got)
	}
	// The lease handle itself refuses at once after it learns of the loss.
	if err := la.Check(ctx); !errors.Is(err, lock.ErrLeaseLost) {
		t.Fatalf("Check = %v", err)
	}
	if err := la.RunTx(ctx, func(pgx.Tx) error { return nil }); !errors.Is(err, lock.ErrLeaseLost) {
		t.Fatalf("RunTx after loss = %v", err)
	}
}

// The same story with a resource fence: the data and its fence
// live in a second schema, which knows nothing of the leases table.
func TestStaleLeaderIsRefusedByResourceFence(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	data := db.Schema + "_data"
	if _, err := migrations.Up(ctx, db.Pool, data); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{data}.Sanitize()+" CASCADE")
	})
	ledger := pgx.Identifier{data, "ledger"}.Sanitize()
	mustExec(t, db, "CREATE TABLE "+ledger+" (who text, token bigint)")
	res := fence.Resource{Name: "ledger", Schema: data}

	a := newClient(t, db, lock.Config{Holder: "A"})
	b := newClient(t, db, lock.Config{Holder: "B"})
	write := func(tok fence.Token, who string) error {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, "INSERT INTO "+ledger+" VALUES ($1, $2)", who, int64(tok)); err != nil {
			return err
		}
		if err := res.Admit(ctx, tx, tok); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	la, _ := a.TryAcquire(ctx, "ledger-writer")
	if err := write(la.Token(), "A"); err != nil {
		t.Fatal(err)
	}
	expire(t, db, "ledger-writer")
	lb, err := b.TryAcquire(ctx, "ledger-writer")
	if err != nil {
		t.Fatal(err)
	}
	if err := write(lb.Token(), "B"); err != nil {
		t.Fatal(err)
	}
	err = write(la.Token(), "A")
	var stale *fence.StaleTokenError
	if !errors.As(err, &stale) || stale.Resource != "ledger" || stale.Presented != la.Token() || stale.Current != lb.Token() {
		t.Fatalf("stale write through resource fence: %v", err)
	}
	if got := rows(t, db, "SELECT who FROM "+ledger+" ORDER BY token"); fmt.Sprint(got) != "[A B]" {
		t.Fatalf("ledger = %v", got)
	}
	if cur, err := res.Current(ctx, db.Pool); err != nil || cur != lb.Token() {
		t.Fatalf("Current = %d, %v", cur, err)
	}
	// The same token again is admitted (>=): B may write many times.
	if err := write(lb.Token(), "B"); err != nil {
		t.Fatalf("second write with the current token: %v", err)
	}
}

// Resource.Exec pipelines the admission with the transaction's first
// statement: the current token's row is written; a stale token's statement
// never runs, and its transaction cannot commit.
func TestResourceExecPipelined(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	tbl := table(db, "items")
	mustExec(t, db, "CREATE TABLE "+tbl+" (token bigint NOT NULL)")
	res := fence.Resource{Name: "items", Schema: db.Schema}
	write := func(tok fence.Token) error {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		tag, err := res.Exec(ctx, tx, tok, "INSERT INTO "+tbl+" VALUES ($1)", int64(tok))
		if err != nil {
			if cerr := tx.Commit(ctx); cerr == nil {
				t.Errorf("token %d: commit succeeded after a refused admission", tok)
			}
			return err
		}
		if tag.RowsAffected() != 1 {
			t.Errorf("token %d: %d rows inserted", tok, tag.RowsAffected())
		}
		return tx.Commit(ctx)
	}
	for _, tok := range []fence.Token{5, 5, 9} {
		if err := write(tok); err != nil {
			t.Fatalf("token %d: %v", tok, err)
		}
	}
	var stale *fence.StaleTokenError
	if err := write(7); !errors.As(err, &stale) || stale.Resource != "items" || stale.Current != 9 {
		t.Fatalf("stale token 7 = %v, want refused with current 9", err)
	}
	if got := rows(t, db, "SELECT token FROM "+tbl+" ORDER BY token"); fmt.Sprint(got) != "[5 5 9]" {
		t.Fatalf("rows = %v", got)
	}
	if _, err := res.Exec(ctx, nil, 9, "SELECT 1"); !errors.Is(err, fence.ErrNilTx) {
		t.Fatalf("nil tx: %v", err)
	}
	if _, err := (fence.Resource{Schema: db.Schema}).Exec(ctx, nil, 9, "SELECT 1"); err == nil {
		t.Fatal("a nil tx with an empty resource name was accepted")
	}
}

// Concurrent admissions to a fresh resource (so several race to insert its
// fence row) are serialised by the fence row: in the order they committed,
// the admitted tokens never go down, every refusal names a greater admitted
// token, and the mark ends at the greatest token admitted.
func TestResourceConcurrentAdmissions(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	tbl := table(db, "admitted")
	mustExec(t, db, "CREATE TABLE "+tbl+" (seq bigserial, token bigint NOT NULL)")
	res := fence.Resource{Name: "race", Schema: db.Schema}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tok := fence.Token(1 + i%8)
			<-start
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			defer tx.Rollback(ctx)
			// The serial is drawn after the admission, under the fence
			// row's lock, so it orders the admitted transactions.
			_, err = res.Exec(ctx, tx, tok, "INSERT INTO "+tbl+" (token) VALUES ($1)", int64(tok))
			var stale *fence.StaleTokenError
			switch {
			case errors.As(err, &stale):
				if stale.Current <= tok {
					t.Errorf("token %d refused with current %d", tok, stale.Current)
				}
				return
			case err != nil:
				t.Error(err)
				return
			}
			if err := tx.Commit(ctx); err != nil {
				t.Error(err)
			}
		}()
	}
	close(start)
	wg.Wait()
	got := rows(t, db, "SELECT token FROM "+tbl+" ORDER BY seq")
	if len(got) == 0 {
		t.Fatal("nothing was admitted")
	}
	var last, highest int64
	for _, v := range got {
		tok, err := strconv.ParseInt(v, 10, 64)
		if err != nil || tok < last {
			t.Fatalf("admitted tokens in commit order %v go down", got)
		}
		last, highest = tok, max(highest, tok)
	}
	if cur, err := res.Current(ctx, db.Pool); err != nil || int64(cur) != highest {
		t.Fatalf("mark %d, %v; want the greatest admitted, %d", cur, err, highest)
	}
}

// A refused guarded transaction leaves no trace, even when the
// caller ran statements before the check and tries to commit anyway.
func TestRefusedTransactionLeavesNoTrace(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	tbl := table(db, "items")
	mustExec(t, db, "CREATE TABLE "+tbl+" (v text)")
	c := newClient(t, db, lock.Config{})
	l, _ := c.TryAcquire(ctx, "items")
	old := l.Guard()
	_ = l.Release(ctx)
	if _, err := c.TryAcquire(ctx, "items"); err != nil { // token moves on
		t.Fatal(err)
	}

	// Caller-managed transaction: write, check, commit regardless.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES ('before-check')"); err != nil {
		t.Fatal(err)
	}
	if err := old.Check(ctx, tx); !errors.Is(err, fence.ErrStaleToken) {
		t.Fatalf("Check = %v", err)
	}
	if err := tx.Commit(ctx); err == nil {
		t.Fatal("commit of a refused transaction succeeded")
	}
	// Pipelined form: the statement behind a failed check never runs.
	tx, _ = db.Pool.Begin(ctx)
	if _, err := old.Exec(ctx, tx, "INSERT INTO "+tbl+" VALUES ('pipelined')"); !errors.Is(err, fence.ErrStaleToken) {
		t.Fatalf("Exec = %v", err)
	}
	_ = tx.Commit(ctx)
	// RunTx: fn's first statement carries the check and never runs;
	// an fn that sends nothing is checked before COMMIT.
	var execErr error
	err = old.RunTx(ctx, db.Pool, func(tx pgx.Tx) error {
		_, execErr = tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES ('runtx')")
		return execErr
	})
	if !errors.Is(err, fence.ErrStaleToken) || !errors.Is(execErr, fence.ErrStaleToken) {
		t.Fatalf("RunTx = %v, fn's Exec = %v", err, execErr)
	}
	err = old.RunTx(ctx, db.Pool, func(tx pgx.Tx) error {
		var n int
		return tx.QueryRow(ctx, "SELECT count(*) FROM "+tbl).Scan(&n)
	})
	if !errors.Is(err, fence.ErrStaleToken) {
		t.Fatalf("RunTx with QueryRow = %v", err)
	}
	if err := old.RunTx(ctx, db.Pool, func(pgx.Tx) error { return nil }); !errors.Is(err, fence.ErrStaleToken) {
		t.Fatalf("RunTx with an empty fn = %v", err)
	}
	// RunTx whose fn fails: rolled back, error returned as is.
	boom := errors.New("boom")
	l2, _ := c.TryAcquire(ctx, "items2")
	err = l2.RunTx(ctx, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES ('fn-failed')"); err != nil {
			return err
		}
		return boom
	})
	if err != boom {
		t.Fatalf("RunTx = %v, want fn's error", err)
	}
	if got := rows(t, db, "SELECT v FROM "+tbl); len(got) != 0 {
		t.Fatalf("refused transactions left rows: %v", got)
	}
}

// A takeover waits for an open guarded transaction (seen in
// pg_locks and by time), while the holder's renewals are not blocked.
func TestTakeoverWaitsForGuardedTransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	// The guarded transaction below stays open, idle, for longer than the
	// TTL on purpose: no idle bound, and a taker that waits for it
	// (TestFrozenHolderInGuardedTx has the others).
	holder := newClient(t, db, lock.Config{TTL: 3 * time.Second})
	taker, _, app := newTaker(t, db)

	l, err := holder.TryAcquire(ctx, "wait")
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := l.Guard().Check(ctx, tx); err != nil {
		t.Fatal(err)
	}
	// Renewals go through while the guarded transaction is open: after four
	// of them (more than a TTL) the lease is still live.
	before := holder.Stats().Renewals
	pgtest.Eventually(t, 40*time.Second, "four renewals with the guarded transaction open", func() bool {
		return holder.Stats().Renewals-before >= 4 || l.Err() != nil
	})
	if err := l.Check(ctx); err != nil {
		t.Fatalf("renewal blocked by the guarded transaction: %v", err)
	}
	// Now the holder "pauses": its lease expires at the database, and a
	// takeover starts. It must wait for the open guarded transaction.
	expire(t, db, "wait")
	type res struct {
		l   *lock.Lease
		err error
		at  time.Time
	}
	done := make(chan res, 1)
	go func() {
		l2, err := taker.TryAcquire(ctx, "wait")
		done <- res{l2, err, time.Now()}
	}()
	// Observe the taker's backend waiting on a lock held by the guard.
	var waiting bool
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && !waiting; time.Sleep(20 * time.Millisecond) {
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock')`, app).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
	}
	if !waiting {
		t.Fatal("the takeover did not wait on a lock held by the guarded transaction")
	}
	select {
	case r := <-done:
		t.Fatalf("takeover completed while the guarded transaction was open: %+v", r)
	case <-time.After(300 * time.Millisecond):
	}
	committed := time.Now()
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("guarded commit: %v", err)
	}
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.at.Before(committed) || r.l.Token() <= l.Token() {
		t.Fatalf("takeover at %v (commit at %v), token %d", r.at, committed, r.l.Token())
	}
	t.Logf("takeover waited; it completed %v after the guarded commit", r.at.Sub(committed))
}

// The other direction: a guarded transaction whose check starts while a
// takeover is in flight (its UPDATE done, its commit not yet) waits for the
// takeover and is then refused. The acquisition locks the row FOR UPDATE
// before its (HOT, non-key) UPDATE, which makes PostgreSQL record that update
// as a key update, so the check's FOR KEY SHARE conflicts with it. The
// control shows why the explicit lock matters: a token raised by a bare
// UPDATE (an operator by hand) does not make the check wait, and the check
// passes with the token being replaced.
func TestGuardWaitsForTakeoverInFlight(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	leases := table(db, "pgfence_leases")
	// Every token change waits inside its statement, before the commit,
	// at a gate the test holds (an advisory lock of this schema's).
	gate, err := db.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		_, _ = gate.Exec(context.Background(), "SELECT pg_advisory_unlock_all()")
		gate.Release()
	}()
	var key int64
	if err := gate.QueryRow(ctx, "SELECT hashtext($1)", db.Schema).Scan(&key); err != nil {
		t.Fatal(err)
	}
	mustExec(t, db, "CREATE FUNCTION "+table(db, "gated")+"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_advisory_xact_lock("+
		strconv.FormatInt(key, 10)+"); RETURN NULL; END $$")
	mustExec(t, db, "CREATE TRIGGER gated AFTER UPDATE ON "+leases+" FOR EACH ROW WHEN (NEW.token <> OLD.token) EXECUTE FUNCTION "+table(db, "gated")+"()")
	holder := newClient(t, db, lock.Config{})
	taker, takerPool, app := newTaker(t, db)

	for _, tc := range []struct {
		name     string
		takeover func(name string) error
		waits    bool
	}{
		{"library acquisition", func(name string) error {
			l, err := taker.TryAcquire(ctx, name)
			if err == nil {
				err = l.Release(ctx)
			}
			return err
		}, true},
		{"bare UPDATE (control)", func(name string) error {
			_, err := takerPool.Exec(ctx, "UPDATE "+leases+" SET token = DEFAULT, holder = 'by hand', secret = '\\x00', session = NULL WHERE name = $1", name)
			return err
		}, false},
	} {
		name := pgtest.UniqueName("inflight")
		l, err := holder.TryAcquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		expire(t, db, name)
		if _, err := gate.Exec(ctx, "SELECT pg_advisory_lock($1)", key); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- tc.takeover(name) }()
		// Wait until the takeover has updated the row and waits at the
		// gate, before its commit.
		var takeover int64
		pgtest.Eventually(t, 20*time.Second, tc.name+": the takeover to wait at the gate", func() bool {
			err := db.Pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
				WHERE application_name = $1 AND wait_event_type = 'Lock' AND wait_event = 'advisory'`, app).Scan(&takeover)
			return err == nil
		})
		checked := make(chan error, 1)
		go func() {
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				checked <- err
				return
			}
			defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
			checked <- l.Guard().Check(ctx, tx)
		}()
		// The takeover cannot commit while the gate is shut, so a check
		// that waits for it is seen waiting, and one that does not
		// returns first.
		var checkErr error
		if tc.waits {
			pgtest.Eventually(t, 20*time.Second, tc.name+": the check to wait for the takeover", func() bool {
				var n int
				err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, takeover).Scan(&n)
				return err == nil && n > 0
			})
		} else {
			select {
			case checkErr = <-checked:
			case <-time.After(20 * time.Second):
				t.Fatalf("%s: the check still waits for a takeover that has not committed", tc.name)
			}
		}
		if _, err := gate.Exec(ctx, "SELECT pg_advisory_unlock($1)", key); err != nil {
			t.Fatal(err)
		}
		if tc.waits {
			checkErr = <-checked
		}
		if tc.waits && !errors.Is(checkErr, fence.ErrStaleToken) {
			t.Fatalf("%s: check = %v; want it to wait for the takeover and be refused", tc.name, checkErr)
		}
		if !tc.waits && checkErr != nil {
			t.Fatalf("%s: check = %v; the control expected it to pass at once", tc.name, checkErr)
		}
		if err := <-done; err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		t.Logf("%s: check during the takeover: %v", tc.name, checkErr)
	}
}

// Bad input gets the documented errors.
func TestBadInput(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c := newClient(t, db, lock.Config{})
	l, _ := c.TryAcquire(ctx, "known")
	tx, _ := db.Pool.Begin(ctx)
	defer tx.Rollback(ctx)
	cases := []struct {
		name string
		err  error
		want error
	}{
		{"zero token", fence.Guard{Lease: "known", Token: 0, Schema: db.Schema}.Check(ctx, tx), fence.ErrInvalidToken},
		{"negative token", fence.Guard{Lease: "known", Token: -3, Schema: db.Schema}.Check(ctx, tx), fence.ErrInvalidToken},
		{"empty lease", fence.Guard{Lease: "", Token: 1, Schema: db.Schema}.Check(ctx, tx), fence.ErrInvalidName},
		{"nil tx", l.Guard().Check(ctx, nil), fence.ErrNilTx},
		{"nil tx exec", func() error { _, err := l.Guard().Exec(ctx, nil, "SELECT 1"); return err }(), fence.ErrNilTx},
		{"future token", fence.Guard{Lease: "known", Token: l.Token() + 5, Schema: db.Schema}.RunTx(ctx, db.Pool, func(pgx.Tx) error { return nil }), fence.ErrTokenNotIssued},
		{"unknown lease", fence.Guard{Lease: "never-acquired", Token: 1, Schema: db.Schema}.RunTx(ctx, db.Pool, func(pgx.Tx) error { return nil }), fence.ErrUnknownLease},
		{"resource zero token", fence.Resource{Name: "r", Schema: db.Schema}.Admit(ctx, tx, 0), fence.ErrInvalidToken},
		{"resource nil tx", fence.Resource{Name: "r", Schema: db.Schema}.Admit(ctx, nil, 1), fence.ErrNilTx},
		{"resource bad name", fence.Resource{Name: "a\x00b", Schema: db.Schema}.Admit(ctx, tx, 1), fence.ErrInvalidName},
		{"parse", func() error { _, err := fence.ParseToken("12x"); return err }(), fence.ErrInvalidToken},
		{"parse negative", func() error { _, err := fence.ParseToken("-3"); return err }(), fence.ErrInvalidToken},
	}
	for _, tc := range cases {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, tc.err, tc.want)
		}
	}
	closed, _ := db.Pool.Begin(ctx)
	_ = closed.Rollback(ctx)
	if err := l.Guard().Check(ctx, closed); !errors.Is(err, fence.ErrTxClosed) {
		t.Errorf("closed tx: %v", err)
	}
	if err := (fence.Resource{Name: "r", Schema: db.Schema}).Admit(ctx, closed, 1); !errors.Is(err, fence.ErrTxClosed) {
		t.Errorf("resource closed tx: %v", err)
	}
	tok, err := fence.ParseToken(l.Token().String())
	if err != nil || tok != l.Token() {
		t.Errorf("round trip %v: %v, %v", l.Token(), tok, err)
	}
}

// Retries: a serialization failure inside RunTx runs the whole transaction
// again; a stale token is never retried.
func TestRunTxRetriesSerializationFailures(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c := newClient(t, db, lock.Config{})
	l, _ := c.TryAcquire(ctx, "retry")
	var mu sync.Mutex
	attempts := 0
	err := l.RunTx(ctx, func(tx pgx.Tx) error {
		mu.Lock()
		attempts++
		n := attempts
		mu.Unlock()
		if n < 3 {
			_, err := tx.Exec(ctx, "DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$")
			return err
		}
		return nil
	})
	if err != nil || attempts != 3 {
		t.Fatalf("err = %v after %d attempts, want success on the third", err, attempts)
	}
}

func rows(t testing.TB, db *pgtest.DB, sql string) []string {
	t.Helper()
	r, err := db.Pool.Query(context.Background(), sql)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(r, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// The pipelined first statement works for every way of sending it.
func TestRunTxPipelinedForms(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	tbl := table(db, "forms")
	mustExec(t, db, "CREATE TABLE "+tbl+" (v int)")
	c := newClient(t, db, lock.Config{})
	l, _ := c.TryAcquire(ctx, "forms")
	forms := map[string]func(tx pgx.Tx) error{
		"exec": func(tx pgx.Tx) error { _, err := tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES (1)"); return err },
		"query": func(tx pgx.Tx) error {
			r, err := tx.Query(ctx, "INSERT INTO "+tbl+" VALUES (2) RETURNING v")
			if err != nil {
				return err
			}
			vs, err := pgx.CollectRows(r, pgx.RowTo[int32])
			if err == nil && (len(vs) != 1 || vs[0] != 2) {
				err = fmt.Errorf("got %v", vs)
			}
			return err
		},
		"queryrow": func(tx pgx.Tx) error {
			var v int32
			return tx.QueryRow(ctx, "INSERT INTO "+tbl+" VALUES (3) RETURNING v").Scan(&v)
		},
		"batch": func(tx pgx.Tx) error {
			b := &pgx.Batch{}
			b.Queue("INSERT INTO " + tbl + " VALUES (4)")
			return tx.SendBatch(ctx, b).Close()
		},
		"norows": func(tx pgx.Tx) error {
			var v int32
			if err := tx.QueryRow(ctx, "SELECT v FROM "+tbl+" WHERE v < 0").Scan(&v); !errors.Is(err, pgx.ErrNoRows) {
				return fmt.Errorf("want ErrNoRows, got %v", err)
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES (5)")
			return err
		},
	}
	for name, fn := range forms {
		if err := l.RunTx(ctx, fn); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	if got := rows(t, db, "SELECT string_agg(v::text, ',' ORDER BY v) FROM "+tbl); got[0] != "1,2,3,4,5" {
		t.Fatalf("rows = %v", got)
	}
}

// Fold: a single autocommitted statement carries its own fence.
func TestFoldedCheck(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	tbl := table(db, "folded")
	mustExec(t, db, "CREATE TABLE "+tbl+" (v int)")
	c := newClient(t, db, lock.Config{})
	l, _ := c.TryAcquire(ctx, "fold")
	old := l.Guard()
	insert := func(g fence.Guard, v int) error {
		f, err := g.Fold(1)
		if err != nil {
			return err
		}
		_, err = db.Pool.Exec(ctx, "INSERT INTO "+tbl+" SELECT $1 FROM (SELECT "+f.Expr+") f", append([]any{v}, f.Args...)...)
		return f.Err(err)
	}
	if err := insert(old, 1); err != nil {
		t.Fatal(err)
	}
	_ = l.Release(ctx)
	l2, _ := c.TryAcquire(ctx, "fold")
	if err := insert(old, 2); !errors.Is(err, fence.ErrStaleToken) {
		t.Fatalf("stale folded insert: %v", err)
	}
	if err := insert(l2.Guard(), 3); err != nil {
		t.Fatal(err)
	}
	if got := rows(t, db, "SELECT string_agg(v::text, ',' ORDER BY v) FROM "+tbl); got[0] != "1,3" {
		t.Fatalf("rows = %v", got)
	}
	// An invalid guard is an error, not an empty expression
	// that becomes a syntax error at run time.
	if f, err := (fence.Guard{Lease: "fold", Token: 0}).Fold(1); !errors.Is(err, fence.ErrInvalidToken) || f.Expr != "" {
		t.Fatalf("Fold of an invalid guard = %q, %v; want ErrInvalidToken", f.Expr, err)
	}
	if _, err := old.Fold(-1); err == nil {
		t.Fatal("Fold(-1) was accepted")
	}
}

// newTaker returns a client on a pool of its own, whose connections carry a
// unique application_name so a test can watch them in pg_stat_activity.
func newTaker(t *testing.T, db *pgtest.DB) (*lock.Client, *pgxpool.Pool, string) {
	t.Helper()
	app := pgtest.UniqueName("taker")
	pool := pgtest.NewPool(t, app)
	// It waits for the idle transactions the tests keep open on purpose.
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, Logger: pgtest.Quiet, IdleHolderAfter: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c, pool, app
}

// Writers of one term do not queue on a shared resource fence
// (the mark does not move, so a shared lock is enough), while raising the
// mark still waits for every open transaction that admitted the old one,
// and the old token is refused after it.
func TestResourceAdmissionsOfOneTermShareTheFence(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	res := fence.Resource{Name: "shared", Schema: db.Schema}
	admit := func(pool *pgxpool.Pool, tok fence.Token) (pgx.Tx, error) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return tx, res.Admit(ctx, tx, tok)
	}
	first, err := admit(db.Pool, 5)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	a, err := admit(db.Pool, 5) // stays open
	if err != nil {
		t.Fatal(err)
	}
	defer a.Rollback(ctx)
	// A second writer of the same term is admitted while a is open.
	bctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	b, err := db.Pool.Begin(bctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Rollback(ctx)
	if err := res.Admit(bctx, b, 5); err != nil {
		t.Fatalf("a writer of the same term waited for another one's open transaction: %v", err)
	}
	// The next term's first writer waits for both.
	raiserPool := pgtest.NewPool(t, pgtest.UniqueName("raiser"))
	raised := make(chan error, 1)
	go func() {
		tx, err := admit(raiserPool, 6)
		if err == nil {
			err = tx.Commit(ctx)
		} else {
			_ = tx.Rollback(ctx)
		}
		raised <- err
	}()
	waitLockWait(t, db, raiserPool)
	if err := a.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	waitLockWait(t, db, raiserPool) // still waiting, for b
	select {
	case err := <-raised:
		t.Fatalf("the mark was raised while a transaction that admitted the old one was open (%v)", err)
	default:
	}
	if err := b.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-raised; err != nil {
		t.Fatalf("raise: %v", err)
	}
	late, err := admit(db.Pool, 5)
	defer late.Rollback(ctx)
	var stale *fence.StaleTokenError
	if !errors.As(err, &stale) || stale.Current != 6 {
		t.Fatalf("token 5 after the mark rose to 6: %v", err)
	}
}

// waitLockWait waits until the one backend of pool is waiting for a lock.
func waitLockWait(t *testing.T, db *pgtest.DB, pool *pgxpool.Pool) {
	t.Helper()
	app := pool.Config().ConnConfig.RuntimeParams["application_name"]
	pgtest.Eventually(t, 10*time.Second, "the raising transaction to wait for a lock", func() bool {
		var n int
		if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock'`, app).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n > 0
	})
}

// A Guard built by hand with no Schema uses the default schema, "pgfence",
// where the quick start puts pgfence's tables; a Guard pointed
// at a schema without pgfence's functions says which schema it looked in.
func TestGuardWithoutSchemaUsesTheDefault(t *testing.T) {
	ctx := pgtest.Context(t, time.Minute)
	pool, err := pgxpool.New(ctx, pgtest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrations.Up(ctx, pool, "pgfence"); err != nil { // as the quick start does
		t.Fatal(err)
	}
	lc, err := lock.New(pool, lock.Config{Schema: "pgfence", Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close(ctx)
	l, err := lc.TryAcquire(ctx, "compaction")
	if err != nil {
		t.Fatal(err)
	}
	g := fence.Guard{Lease: "compaction", Token: l.Token()}
	if err := g.RunTx(ctx, pool, func(tx pgx.Tx) error { _, err := tx.Exec(ctx, "SELECT 1"); return err }); err != nil {
		t.Fatalf("a Guard with no Schema: %v", err)
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA elsewhere"); err != nil {
		t.Fatal(err)
	}
	g.Schema = "elsewhere"
	err = g.RunTx(ctx, pool, func(tx pgx.Tx) error { _, err := tx.Exec(ctx, "SELECT 1"); return err })
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || pg.Code != "42883" || !strings.Contains(err.Error(), `schema "elsewhere"`) {
		t.Fatalf("a Guard on a schema without pgfence: %v; want 42883 naming schema \"elsewhere\"", err)
	}
}

package fence_test

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

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// wireFaults are the ways a COMMIT meets the network in production: the
// connection reset right after COMMIT reached the server (whether it
// committed is a race), after the server answered (the reply lost), before
// COMMIT was forwarded, COMMIT forwarded late after the client was reset,
// the reply held past the caller's deadline, and a peer that vanished
// without a FIN.
var wireFaults = []faultproxy.CommitFault{
	faultproxy.ResetAfterCommit, faultproxy.ResetAfterReply, faultproxy.ResetBeforeCommit,
	faultproxy.LateCommit, faultproxy.HoldReply, faultproxy.HalfOpen,
}

// wireDeadline is a transaction's deadline: a held reply or a half-open
// connection ends there, as a caller's request deadline would; the other
// faults get longer, so that the machine's load does not end them first.
func wireDeadline(f faultproxy.CommitFault) time.Duration {
	if f == faultproxy.HoldReply || f == faultproxy.HalfOpen {
		return time.Second
	}
	return 10 * time.Second
}

// proxied opens a pool to the test server through a fault proxy.
func proxied(t *testing.T, db *pgtest.DB) (*faultproxy.Proxy, *pgxpool.Pool) {
	t.Helper()
	link, err := faultproxy.To(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.NewPool(t, pgtest.UniqueName("wire"), func(cfg *pgxpool.Config) {
		link.Route(&cfg.ConnConfig.Config)
		// A connection whose reply is held keeps its pool slot while pgx
		// closes it (up to 15 s): room for all of them.
		cfg.MaxConns = 32
	})
	// Registered after the pool's, so it runs first: pgx closes a
	// connection whose reply is held only once the proxy lets it go.
	t.Cleanup(func() { _ = link.Close() })
	return link, pool
}

// answer is what a transaction's caller was told, and what the table says.
type answer struct {
	id       string
	err      error
	attempts int
}

// judge compares each answer with the table: nil must mean the row is
// there once, any error but ErrOutcomeUnknown (in particular every one that
// fence.Retryable accepts) that it is not. It returns the mismatches and
// the number of unknown outcomes.
func judge(t *testing.T, db *pgtest.DB, tbl string, answers []answer) (mismatches []string, unknown int) {
	t.Helper()
	for _, a := range answers {
		var n int
		if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+tbl+" WHERE id = $1", a.id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		switch {
		case n > 1:
			mismatches = append(mismatches, fmt.Sprintf("%s: %d rows", a.id, n))
		case errors.Is(a.err, fence.ErrOutcomeUnknown):
			// Asked again once the fault is gone, the server must tell
			// the truth.
			unknown++
			var u *fence.UnknownOutcomeError
			if !errors.As(a.err, &u) {
				mismatches = append(mismatches, fmt.Sprintf("%s: %v is no *fence.UnknownOutcomeError", a.id, a.err))
				break
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := u.Resolve(ctx, db.Pool)
			cancel()
			t.Logf("%s: %v; resolved: %v", a.id, a.err, err)
			switch {
			case err == nil && n != 1:
				mismatches = append(mismatches, fmt.Sprintf("%s: resolved committed, no row", a.id))
			case errors.Is(err, fence.ErrNotCommitted) && n != 0:
				mismatches = append(mismatches, fmt.Sprintf("%s: resolved not committed, but committed", a.id))
			case err != nil && !errors.Is(err, fence.ErrNotCommitted):
				mismatches = append(mismatches, fmt.Sprintf("%s: not resolved once the fault was gone: %v", a.id, err))
			}
		case a.err == nil && n != 1:
			mismatches = append(mismatches, fmt.Sprintf("%s: answered committed, no row", a.id))
		case a.err != nil && n != 0:
			mismatches = append(mismatches, fmt.Sprintf("%s: answered %v (retryable %v), but committed", a.id, a.err, fence.Retryable(a.err)))
		}
	}
	return mismatches, unknown
}

// Every answer about a guarded transaction whose COMMIT meets a wire fault
// is true: nil only if it committed, an error (retryable or not) only if it
// did not, ErrOutcomeUnknown never while the server can be asked, and a
// transaction that provably did not commit is run again by RunTx (a fault
// hits only a transaction's first COMMIT, so a second attempt commits).
// Guard.RunTx, Lease.RunTx and Resource.RunTx, each fault several times.
// The same checker catches a naive client that takes a COMMIT error for
// "not committed".
func TestCommitUnderWireFaults(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, 3*time.Minute)
	link, pool := proxied(t, db)
	tbl := table(db, "charges")
	mustExec(t, db, "CREATE TABLE "+tbl+" (id text PRIMARY KEY, token bigint)")
	c := newClient(t, db, lock.Config{})
	l, err := c.TryAcquire(ctx, "wire")
	if err != nil {
		t.Fatal(err)
	}
	res := fence.Resource{Name: "wire", Schema: db.Schema}

	// armed makes the next COMMIT meet fault; later ones pass.
	var armed atomic.Pointer[faultproxy.CommitFault]
	link.OnCommit(func() (faultproxy.CommitFault, time.Duration) {
		if f := armed.Swap(nil); f != nil {
			return *f, 200 * time.Millisecond
		}
		return faultproxy.CommitPass, 0
	})
	forms := map[string]func(ctx context.Context, fn func(pgx.Tx) error) error{
		"Guard.RunTx": func(ctx context.Context, fn func(pgx.Tx) error) error { return l.Guard().RunTx(ctx, pool, fn) },
		"Lease.RunTx": func(ctx context.Context, fn func(pgx.Tx) error) error {
			// The lease's client has its own pool: run on the proxied one
			// with the lease's guard and the lease's context.
			lctx, cancel := context.WithCancel(ctx)
			defer cancel()
			stop := context.AfterFunc(l.Context(), cancel)
			defer stop()
			return l.Guard().RunTx(lctx, pool, fn)
		},
		"Resource.RunTx": func(ctx context.Context, fn func(pgx.Tx) error) error {
			return res.RunTx(ctx, pool, l.Token(), fn)
		},
	}
	const each = 3
	var answers []answer
	byFault := map[faultproxy.CommitFault][]error{}
	took := map[faultproxy.CommitFault]time.Duration{}
	for _, fault := range wireFaults {
		start := time.Now()
		for form, run := range forms {
			for i := range each {
				id := fmt.Sprintf("%v/%s/%d", fault, form, i)
				f := fault
				armed.Store(&f)
				a := answer{id: id}
				tctx, cancel := context.WithTimeout(ctx, wireDeadline(fault))
				deadline, _ := tctx.Deadline()
				a.err = run(tctx, func(tx pgx.Tx) error {
					a.attempts++
					_, err := tx.Exec(tctx, "INSERT INTO "+tbl+" VALUES ($1, $2)", id, int64(l.Token()))
					return err
				})
				cancel()
				if late := time.Since(deadline); late > time.Second {
					t.Errorf("%s: returned %v after its context's deadline", id, late.Round(time.Millisecond))
				}
				answers = append(answers, a)
				byFault[fault] = append(byFault[fault], a.err)
			}
		}
		took[fault] = time.Since(start)
	}
	mismatches, unknown := judge(t, db, tbl, answers)
	for _, m := range mismatches {
		t.Error(m)
	}
	held := 0 // answers whose COMMIT reply was held past the caller's deadline
	for _, a := range answers {
		if strings.HasPrefix(a.id, faultproxy.HoldReply.String()+"/") || strings.HasPrefix(a.id, faultproxy.HalfOpen.String()+"/") {
			held++
		}
	}
	if unknown > held {
		t.Errorf("%d answers were ErrOutcomeUnknown, %d of them although the server could be asked within the deadline", unknown, unknown-held)
	}
	for fault, errs := range byFault {
		committed := 0
		for _, err := range errs {
			if err == nil {
				committed++
			}
		}
		t.Logf("%v: %d of %d committed in %v; e.g. %v", fault, committed, len(errs), took[fault], errs[len(errs)-1])
	}
	// A fault that provably prevents the commit is followed by RunTx's own
	// second attempt, which commits (the faults hit first COMMITs only).
	for _, err := range byFault[faultproxy.ResetBeforeCommit] {
		if err != nil {
			t.Errorf("COMMIT dropped before the server: %v; want RunTx to run the transaction again and commit", err)
		}
	}
	for _, err := range byFault[faultproxy.ResetAfterReply] {
		if err != nil {
			t.Errorf("COMMIT answered, the reply lost: %v; want nil (it committed)", err)
		}
	}
	if got := link.Commits(); got[faultproxy.ResetAfterReply] < each*len(forms) {
		t.Errorf("the proxy saw %v: the faults did not happen", got)
	}

	// Negative control: a client that takes any COMMIT error for "not
	// committed, retry" is caught by the same checker.
	var naive []answer
	for i := range each {
		id := fmt.Sprintf("naive/%d", i)
		f := faultproxy.ResetAfterReply
		armed.Store(&f)
		a := answer{id: id, attempts: 1}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+tbl+" VALUES ($1, 0)", id); err != nil {
			t.Fatal(err)
		}
		a.err = tx.Commit(ctx)
		naive = append(naive, a)
	}
	if m, _ := judge(t, db, tbl, naive); len(m) != len(naive) {
		t.Errorf("the checker caught %d of %d false answers of a naive client: %v", len(m), len(naive), m)
	} else {
		t.Logf("control: the naive client's %d answers were all caught, e.g. %s", len(m), m[0])
	}
}

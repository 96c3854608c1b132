package pgfencetest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/pgfencetest"
)

// Toy application code: two ways to record a charge for the leader.
func chargeGuarded(ctx context.Context, l *lock.Lease, customer string) error {
	return l.RunTx(ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO charges VALUES ($1)", customer)
		return err
	})
}

// The bug: the write does not carry the lease's guard.
func chargeUnguarded(ctx context.Context, pool *pgxpool.Pool, _ *lock.Lease, customer string) error {
	_, err := pool.Exec(ctx, "INSERT INTO charges VALUES ($1)", customer)
	return err
}

func setup(t *testing.T) (*pgfencetest.DB, *lock.Lease) {
	db := pgfencetest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{db.Schema, "charges"}.Sanitize()+" (customer text)"); err != nil {
		t.Fatal(err)
	}
	// The toy code writes to "charges" on the search_path.
	if _, err := db.Pool.Exec(ctx, "SET search_path TO "+pgx.Identifier{db.Schema}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	cfg := db.Pool.Config()
	cfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{db.Schema}.Sanitize()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	db.Pool = pool
	l, err := db.Client(t, lock.Config{}).TryAcquire(ctx, "billing")
	if err != nil {
		t.Fatal(err)
	}
	return db, l
}

// TakeOver catches a write that is not fenced: after another holder takes
// the lease over, the guarded write is refused and the unguarded one is not.
func TestTakeOverCatchesAnUnfencedWrite(t *testing.T) {
	db, l := setup(t)
	ctx := context.Background()
	db.TakeOver(t, "billing")
	if err := chargeGuarded(ctx, l, "alice"); !errors.Is(err, fence.ErrFenced) {
		t.Fatalf("guarded write after a takeover: %v, want fence.ErrFenced", err)
	}
	if err := chargeUnguarded(ctx, db.Pool, l, "alice"); err != nil {
		t.Fatal(err)
	}
	// The bug shows: the stale leader's unguarded charge went through.
	var n int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM charges").Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d charges (%v), want exactly the unguarded one", n, err)
	}
}

// recorder is a TB whose failures are kept, to show a helper failing.
type recorder struct {
	*testing.T
	failures []string
}

func (r *recorder) Errorf(format string, args ...any) {
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) {
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}

// AssertUnderLease catches code that runs without its lease.
func TestAssertUnderLeaseCatchesUnleasedCode(t *testing.T) {
	_, l := setup(t)
	nightly := func(tb pgfencetest.TB, ctx context.Context) { pgfencetest.AssertUnderLease(tb, ctx, "billing") }

	ok := &recorder{T: t}
	nightly(ok, l.Context())
	if len(ok.failures) != 0 {
		t.Fatalf("under its lease: %v", ok.failures)
	}
	bug := &recorder{T: t}
	nightly(bug, context.Background()) // the bug: called outside the Election
	if len(bug.failures) != 1 {
		t.Fatalf("outside any lease: %v, want one failure", bug.failures)
	}
	ended := &recorder{T: t}
	_ = l.Release(context.Background())
	nightly(ended, l.Context())
	if len(ended.failures) != 1 {
		t.Fatalf("after the lease ended: %v, want one failure", ended.failures)
	}
}

// Expire catches a loop that does not stop when its lease ends.
func TestExpireCatchesALoopThatIgnoresItsLease(t *testing.T) {
	db, l := setup(t)
	process := func(ctx context.Context, items int, checkLease bool, onItem func(int)) int {
		done := 0
		for i := range items {
			if checkLease && ctx.Err() != nil {
				break
			}
			onItem(i)
			done++
		}
		return done
	}
	expireAt3 := func(i int) {
		if i == 2 {
			db.Expire(t, l)
		}
	}
	if got := process(l.Context(), 10, true, expireAt3); got != 3 {
		t.Fatalf("the careful loop processed %d items, want 3 (it stops once the lease ends)", got)
	}
	if !errors.Is(l.Err(), lock.ErrLeaseLost) {
		t.Fatalf("after Expire: %v, want ErrLeaseLost", l.Err())
	}
	l2, err := db.Client(t, lock.Config{}).TryAcquire(context.Background(), "careless")
	if err != nil {
		t.Fatal(err)
	}
	l = l2
	if got := process(l.Context(), 10, false, expireAt3); got != 10 {
		t.Fatalf("the careless loop processed %d items", got)
	}
	// The bug shows: 7 items were processed after the lease was lost.
}

// New without a database fails the test with a message that says how to
// provide one.
func TestNewWithoutADatabase(t *testing.T) {
	for _, v := range []string{"PGFENCE_TEST_DATABASE_URL", "TEST_DATABASE_URL", "DATABASE_URL"} { // the documented ones
		t.Setenv(v, "")
	}
	r := &recorder{T: t}
	if db := pgfencetest.New(r); db != nil || len(r.failures) != 1 {
		t.Fatalf("New without a database: %v, %v", db, r.failures)
	}
}

// exampleT stands in for the *testing.T a test is given.
type exampleT struct{ cleanups []func() }

func (e *exampleT) Helper()                        {}
func (e *exampleT) Fatalf(format string, a ...any) { panic(fmt.Sprintf(format, a...)) }
func (e *exampleT) Errorf(format string, a ...any) { fmt.Printf(format+"\n", a...) }
func (e *exampleT) Cleanup(f func())               { e.cleanups = append(e.cleanups, f) }
func (e *exampleT) done() {
	for i := len(e.cleanups) - 1; i >= 0; i-- {
		e.cleanups[i]()
	}
}

func ExampleDB_TakeOver() {
	t := &exampleT{} // in a test: the *testing.T you are given
	defer t.done()
	db := pgfencetest.New(t)
	ctx := context.Background()
	l, _ := db.Client(t, lock.Config{}).TryAcquire(ctx, "nightly-billing")

	db.TakeOver(t, "nightly-billing") // another replica takes over

	err := l.Guard().RunTx(ctx, db.Pool, func(tx pgx.Tx) error { return nil })
	fmt.Println(errors.Is(err, fence.ErrFenced))
	// Output: true
}

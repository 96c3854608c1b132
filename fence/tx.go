package fence

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/outcome"
)

// guardedTx is the transaction RunTx hands to its function. The fence check
// travels in the same round trip as the function's first Exec, Query or
// QueryRow (pipelined, check first); any other first use, or a function that
// sends nothing, gets the check on its own. Either way no statement of the
// transaction runs before the check has passed.
//
// When bound is set (RunTx's context), every statement also runs under it:
// the statement in flight is cancelled when bound ends, whatever context the
// caller passed. This is what makes a lease's end stop the statements of
// Lease.RunTx even when its function uses its own context.
type guardedTx struct {
	pgx.Tx
	fence   *txFence
	checked bool
	bound   context.Context

	// The transaction's ID, read with the fence, to ask the server what
	// became of it when COMMIT's answer is lost (outcome.Resolve).
	id outcome.ID
}

// txFence is the statement that fences a transaction RunTx runs: a lease's
// check (Guard) or a resource's admission (Resource). It returns the
// fence's value, the transaction's id and the server's timeline, and sets
// the transaction's idle bound, all in the round trip of the transaction's
// first statement.
type txFence struct {
	sql       string
	args      []any
	id        bool                             // sql returns the transaction's id (for RunTx's commit)
	bound     bool                             // sql sets the idle bound (one more column)
	translate func(err error, tx pgx.Tx) error // the fence's refusal as a typed error
	schema    string                           // where pgfence_timeline lives, for outcome.Resolve
	metrics   *Metrics
}

// bind returns a context that ends when ctx or t.bound ends, and the
// function that releases it (call it when the statement is done).
//
// When t.bound ends first, the statement's context is cancelled at once:
// pgx then stops waiting on the socket, closes the connection, and sends
// the server a cancel request from its own goroutine (bounded by pgx), so
// the backend does not go on running the statement and holding the lease
// row's lock. Nothing here waits on the network: the caller returns when
// its bound ends, whatever the network does.
func (t *guardedTx) bind(ctx context.Context) (context.Context, func()) {
	if t.bound == nil || ctx == t.bound || t.bound.Done() == nil {
		return ctx, func() {}
	}
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(t.bound, func() { cancel(context.Cause(t.bound)) })
	return ctx, func() {
		stop()
		cancel(nil)
	}
}

// dest is where the fence's row is scanned.
func (t *guardedTx) dest() []any { return t.fence.dest(&t.id) }

// dest is where the fence's row is scanned: the transaction's id, if the
// fence reads it, into id; the fence's value and the idle bound's are not
// kept.
func (f *txFence) dest(id *outcome.ID) []any {
	var (
		cur  int64
		idle *string
	)
	d := []any{&cur}
	if f.id {
		d = append(d, id.Dest()...)
	}
	if f.bound {
		d = append(d, &idle)
	}
	return d
}

// ensure sends the fence on its own, unless it has been sent.
func (t *guardedTx) ensure(ctx context.Context) error {
	if t.checked {
		return nil
	}
	start := time.Now()
	err := t.Tx.QueryRow(ctx, t.fence.sql, t.fence.args...).Scan(t.dest()...)
	t.fence.metrics.checked(ctx, start)
	if err != nil {
		err = t.fence.translate(err, t.Tx)
		t.fence.metrics.outcome(ctx, err, false)
		return err
	}
	t.checked = true
	return nil
}

// pipeline sends the fence and one statement in one batch and returns the
// open batch positioned at the statement's result.
func (t *guardedTx) pipeline(ctx context.Context, sql string, args []any) (pgx.BatchResults, error) {
	br, err := pipelined(ctx, t.Tx, t.fence.sql, t.fence.args, t.dest(), sql, args)
	if err != nil {
		return nil, t.fence.translate(err, t.Tx)
	}
	t.checked = true
	return br, nil
}

// pipelined sends a fence (check, or admission) and one statement in one
// batch, the fence first, and scans the fence's row into into. It returns
// the open batch positioned at the statement's result, or the fence's
// error (the batch closed, the statement not run: its transaction is
// aborted). The one round trip of Guard.Exec, RunTx's first statement and
// Resource.Exec.
func pipelined(ctx context.Context, tx pgx.Tx, fence string, fenceArgs, into []any, sql string, args []any) (pgx.BatchResults, error) {
	b := &pgx.Batch{}
	b.Queue(fence, fenceArgs...)
	b.Queue(sql, args...)
	br := tx.SendBatch(ctx, b)
	if err := br.QueryRow().Scan(into...); err != nil {
		_ = br.Close()
		return nil, err
	}
	return br, nil
}

func (t *guardedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	ctx, done := t.bind(ctx)
	defer done()
	if t.checked {
		return t.Tx.Exec(ctx, sql, args...)
	}
	br, err := t.pipeline(ctx, sql, args)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, err
}

func (t *guardedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	ctx, done := t.bind(ctx)
	if t.checked {
		rows, err := t.Tx.Query(ctx, sql, args...)
		if err != nil {
			done()
			return nil, err
		}
		return &closingRows{Rows: rows, finish: func() error { done(); return nil }}, nil
	}
	br, err := t.pipeline(ctx, sql, args)
	if err != nil {
		done()
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		_ = br.Close()
		done()
		return nil, err
	}
	return &closingRows{Rows: rows, finish: func() error { defer done(); return br.Close() }}, nil
}

func (t *guardedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := t.Query(ctx, sql, args...)
	return &row{rows: rows, err: err}
}

func (t *guardedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	ctx, done := t.bind(ctx)
	if err := t.ensure(ctx); err != nil {
		done()
		return errBatch{err}
	}
	return &boundBatch{BatchResults: t.Tx.SendBatch(ctx, b), done: done}
}

func (t *guardedTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	ctx, done := t.bind(ctx)
	defer done()
	if err := t.ensure(ctx); err != nil {
		return 0, err
	}
	return t.Tx.CopyFrom(ctx, table, cols, src)
}

// Begin starts a savepoint whose statements are bound and checked like
// the transaction's own.
func (t *guardedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.ensure(ctx); err != nil {
		return nil, err
	}
	inner, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &guardedTx{Tx: inner, fence: t.fence, checked: true, bound: t.bound}, nil
}

// boundBatch releases its batch's bound context when closed.
type boundBatch struct {
	pgx.BatchResults
	done func()
}

func (b *boundBatch) Close() error {
	defer b.done()
	return b.BatchResults.Close()
}

// closingRows runs finish once the rows are done (read to the end or
// closed): closing the batch that carried the query, if any, and releasing
// the statement's bound context. finish's error is reported by Err.
type closingRows struct {
	pgx.Rows
	finish    func() error
	finished  bool
	finishErr error
}

func (r *closingRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *closingRows) Close() {
	r.Rows.Close()
	if !r.finished {
		r.finished = true
		r.finishErr = r.finish()
	}
}

func (r *closingRows) Err() error {
	if err := r.Rows.Err(); err != nil {
		return err
	}
	return r.finishErr
}

// row implements pgx.Row over rows, as pgx's own QueryRow does.
type row struct {
	rows pgx.Rows
	err  error
}

func (r *row) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

type errBatch struct{ err error }

func (e errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, e.err }
func (e errBatch) Query() (pgx.Rows, error)         { return nil, e.err }
func (e errBatch) QueryRow() pgx.Row                { return &row{err: e.err} }
func (e errBatch) Close() error                     { return e.err }
func (e errBatch) Tx() pgx.Tx                       { return nil }

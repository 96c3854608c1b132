package fence

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
)

// Resource is a resource fence: a high-water mark of admitted tokens kept in
// the pgfence_fences table next to the protected data (run the migrations in
// that database and schema). Use it when the data does not live next to the
// leases table, or when several leases write the same data.
//
// Admit in the transaction that writes the data: the token is admitted only if
// it is >= the highest token admitted so far, and the mark cannot move until
// the transaction ends, so two writers with different tokens are ordered and
// the lower one is refused. Writers of the same token (one leadership term)
// share the fence row's lock and do not wait for one another; the first
// writer of a greater token waits for them, then raises the mark.
type Resource struct {
	// Name identifies the protected resource (1-255 bytes of UTF-8).
	Name string
	// Schema holds the pgfence_fences table (default "pgfence").
	Schema string
	// Metrics records refusals; nil uses the global MeterProvider's.
	Metrics *Metrics
	// IdleTimeout bounds how long a transaction that admitted a token may
	// sit idle between its statements holding the fence row's lock, which
	// a writer of a greater token waits for (see Guard.IdleTimeout). The
	// rule is Guard's: 0 is the default, here DefaultIdleTimeout (a
	// resource has no lease whose takers end idle holders); negative is
	// none (the session's setting is left alone); positive is the bound.
	IdleTimeout time.Duration
}

func (r Resource) validate(t Token) error {
	if err := ValidateName(r.Name); err != nil {
		return err
	}
	if !t.Valid() {
		return ErrInvalidToken
	}
	return ident.ValidateSchema(r.Schema)
}

// Admit raises the resource's high-water mark to t inside tx, or returns a
// *StaleTokenError (Resource set) if a greater token has been admitted, in
// which case tx is aborted and nothing it did can commit.
func (r Resource) Admit(ctx context.Context, tx pgx.Tx, t Token) error {
	if err := ctxcheck.NotNil(ctx, "fence: Resource.Admit"); err != nil {
		return err
	}
	if tx == nil {
		return ErrNilTx
	}
	if err := r.validate(t); err != nil {
		return err
	}
	f := r.fence(t, false)
	start := time.Now()
	err := r.translate(tx.QueryRow(ctx, f.sql, f.args...).Scan(f.dest(nil)...), t, tx)
	m := r.metrics()
	m.checked(ctx, start)
	if errors.Is(err, ErrFenced) {
		m.outcome(ctx, err, false)
	}
	return err
}

// Exec runs sql in tx with Admit pipelined in front of it: one round trip
// for both. If the token is refused (a *StaleTokenError, Resource set), sql
// does not run and tx is aborted. Use it for a fenced transaction's first
// statement on hot paths.
func (r Resource) Exec(ctx context.Context, tx pgx.Tx, t Token, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := ctxcheck.NotNil(ctx, "fence: Resource.Exec"); err != nil {
		return pgconn.CommandTag{}, err
	}
	if tx == nil {
		return pgconn.CommandTag{}, ErrNilTx
	}
	if err := r.validate(t); err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := (&guardedTx{Tx: tx, fence: r.fence(t, false)}).Exec(ctx, sql, args...)
	if errors.Is(err, ErrFenced) {
		r.metrics().outcome(ctx, err, false)
	}
	return tag, err
}

// RunTx runs fn in a transaction on db that admits t first: begin, admit,
// fn, commit, with the admission pipelined with fn's first Exec, Query or
// QueryRow (no statement of fn runs unless t was admitted, and a refusal,
// a *StaleTokenError with Resource set, is what that first call returns).
// It answers as Guard.RunTx does, and with the same truth: nil only if the
// transaction committed; ErrOutcomeUnknown only if the server cannot be
// asked within ctx; any other error, nothing of it committed. Transactions that
// provably did not commit for a passing reason run again (fn included), up
// to MaxAttempts times.
func (r Resource) RunTx(ctx context.Context, db DB, t Token, fn func(tx pgx.Tx) error) error {
	if err := ctxcheck.NotNil(ctx, "fence: Resource.RunTx"); err != nil {
		return err
	}
	if err := r.validate(t); err != nil {
		return err
	}
	return runTx(ctx, db, r.fence(t, true), fn)
}

// fence is the resource's admission of t as the fence of a transaction:
// with id, of one RunTx commits.
func (r Resource) fence(t Token, id bool) *txFence {
	f := &txFence{
		args:      []any{r.Name, int64(t)},
		id:        id,
		translate: func(err error, tx pgx.Tx) error { return r.translate(err, t, tx) },
		schema:    r.Schema,
		metrics:   r.metrics(),
	}
	if ms := idleMillis(r.IdleTimeout, DefaultIdleTimeout); ms > 0 {
		f.bound = true
		f.args = append(f.args, ms)
	}
	f.sql = fenceSQL(r.Schema, "pgfence_admit", f.id, f.bound)
	return f
}

func (r Resource) metrics() *Metrics { return Guard{Metrics: r.Metrics}.metrics() }

// translate maps pgfence_admit's errors, naming the resource in a refusal,
// and says what pgfence was doing when anything else failed.
func (r Resource) translate(err error, t Token, tx pgx.Tx) error {
	if err == nil {
		return nil
	}
	var stale *StaleTokenError
	if tr := translate(err, "", t); errors.As(tr, &stale) {
		stale.Resource = r.Name
		return tr
	}
	return fmt.Errorf("fence: admit token %d to resource %q: %w", t, r.Name, hint.Wrap(err, r.Schema, hint.Role(tx)))
}

// Current returns the highest token the resource has admitted, or 0 if it has
// admitted none.
func (r Resource) Current(ctx context.Context, db DB) (Token, error) {
	if err := ctxcheck.NotNil(ctx, "fence: Resource.Current"); err != nil {
		return 0, err
	}
	if err := r.validate(1); err != nil {
		return 0, err
	}
	var cur int64
	err := db.QueryRow(ctx, r.currentSQL(), r.Name).Scan(&cur)
	return Token(cur), err
}

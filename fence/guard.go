package fence

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgexec"
)

// Guard fences writes with a lease's token. Used inside a transaction, it
// makes that transaction commit only if no token greater than Token has been
// issued for Lease by the time it commits.
//
// The check takes a FOR KEY SHARE lock on the lease row. A takeover locks the
// row FOR UPDATE before it raises the token, so it waits until the guarded
// transaction ends, while renewals of the current holder (which only move the
// expiry) are not blocked. A guarded transaction that stays open therefore
// delays a takeover: keep guarded transactions short. Once the lease has
// expired, a taker ends the session of a guarded transaction that sits idle
// on the row (lock.Config.IdleHolderAfter), or the server does, past
// IdleTimeout; bound single long statements with statement_timeout.
//
// A Guard is a value; the zero Schema means "pgfence", the default schema
// everywhere in pgfence.
type Guard struct {
	// Lease is the lease name.
	Lease string
	// Token is the token obtained when the lease was acquired.
	Token Token
	// Schema holds the pgfence_leases table (default "pgfence").
	Schema string
	// Metrics records the guard's outcomes; nil uses the global
	// MeterProvider's (see Metrics).
	Metrics *Metrics
	// IdleTimeout, if positive, bounds how long a guarded transaction may
	// sit idle between its statements while it holds the lease row's
	// lock, which a takeover waits for: past it the server ends the
	// transaction's session (idle_in_transaction_session_timeout, set for
	// the transaction only, in the check's own round trip, unless the
	// session's own setting is shorter). Without a bound, a holder frozen
	// inside a guarded transaction (a GC pause, SIGSTOP, a stalled VM)
	// holds the row for as long as it is frozen, and the lease's takers
	// end its session themselves once the lease has expired (see
	// lock.Config.IdleHolderAfter); the bound is for takers that do
	// not. It costs a changed setting per transaction (BENCHMARKS.md).
	// Lease.Guard sets the lease client's GuardIdleTimeout. The rule is
	// Resource.IdleTimeout's: 0 is the default (for a guard, none: its
	// lease's takers end idle holders), negative is none, positive is the
	// bound. A statement in progress (a long query, a COPY) is not idle:
	// bound those with statement_timeout.
	IdleTimeout time.Duration
}

// DefaultIdleTimeout is a resource fence's IdleTimeout when it has none:
// lock's default TTL.
const DefaultIdleTimeout = 15 * time.Second

// DB is the database handle pgfence's functions take: *pgxpool.Pool,
// *pgx.Conn and pgx.Tx (a savepoint for Begin) all satisfy it. It is the one
// executor interface of pgfence's packages (fence, lock, runner,
// migrations), with the methods Begin, Exec, Query and QueryRow as pgx
// declares them.
type DB = pgexec.DB

// MaxAttempts is how many times RunTx runs a transaction that provably did
// not commit for a reason that can pass: a serialization failure (40001), a
// deadlock (40P01), a connection lost before COMMIT was sent (a pooled
// connection the server terminated, 57P01), or a COMMIT that the server,
// asked afterwards, reports aborted (ErrNotCommitted).
const MaxAttempts = 3

func (g Guard) validate() error {
	if err := ValidateName(g.Lease); err != nil {
		return err
	}
	if !g.Token.Valid() {
		return fmt.Errorf("%w: %d (tokens start at 1)", ErrInvalidToken, g.Token)
	}
	return ident.ValidateSchema(g.Schema)
}

// Check fences tx: it returns nil if Token is the newest token issued for the
// lease, and from then until tx ends no takeover can commit, so tx's commit is
// fenced. Otherwise it returns a *StaleTokenError (or ErrUnknownLease,
// ErrTokenNotIssued) and tx is aborted: nothing it did or does can commit.
// It costs one round trip; see Exec to save it.
func (g Guard) Check(ctx context.Context, tx pgx.Tx) error {
	if err := ctxcheck.NotNil(ctx, "fence: Guard.Check"); err != nil {
		return err
	}
	if tx == nil {
		return ErrNilTx
	}
	if err := g.validate(); err != nil {
		return err
	}
	f := g.fence(false)
	start := time.Now()
	err := tx.QueryRow(ctx, f.sql, f.args...).Scan(f.dest(nil)...)
	m := g.metrics()
	m.checked(ctx, start)
	if err != nil {
		err = translateCheck(err, g, tx)
		m.outcome(ctx, err, false)
	}
	return err
}

// Exec runs sql in tx with the fence check pipelined in front of it: one round
// trip for both. If the check fails, sql does not run and tx is aborted. Use it
// for a guarded transaction's first statement on hot paths.
func (g Guard) Exec(ctx context.Context, tx pgx.Tx, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := ctxcheck.NotNil(ctx, "fence: Guard.Exec"); err != nil {
		return pgconn.CommandTag{}, err
	}
	if tx == nil {
		return pgconn.CommandTag{}, ErrNilTx
	}
	if err := g.validate(); err != nil {
		return pgconn.CommandTag{}, err
	}
	// The same pipelining RunTx gives its function's first statement.
	tag, err := (&guardedTx{Tx: tx, fence: g.fence(false)}).Exec(ctx, sql, args...)
	if errors.Is(err, ErrFenced) {
		g.metrics().outcome(ctx, err, false)
	}
	return tag, err
}

// RunTx runs fn in a guarded transaction on db: begin, check, fn, commit.
// The check is pipelined with fn's first Exec, Query or QueryRow, so guarding
// costs no extra round trip; no statement of fn runs unless the check passed,
// and the check's error (a *StaleTokenError, ErrUnknownLease,
// ErrTokenNotIssued) is what that first call returns. If fn returns an error the transaction
// rolls back and the error is returned unchanged.
//
// Every statement fn sends through tx runs under ctx as well as under the
// context fn passes: when ctx ends (for Lease.RunTx: when the lease ends),
// the statement in flight is cancelled, whatever context fn gave it.
//
// What RunTx returns is the truth about the commit:
//   - nil: the transaction committed;
//   - an error matching ErrNotCommitted, ErrFenced, or any other error
//     except ErrOutcomeUnknown: it did not commit, and nothing of it took
//     effect;
//   - ErrOutcomeUnknown: it may have committed (see below).
//
// If the transaction provably did not commit for a passing reason (40001,
// 40P01, a connection lost before COMMIT was sent, or a COMMIT the server
// reports aborted), the whole transaction, fn included, runs again, up to
// MaxAttempts times: fn must not have effects outside the transaction.
// When COMMIT fails without the server's own answer (the connection reset
// or closed after COMMIT may have been written, the session terminated, the
// reply held past ctx's end), RunTx asks the server, on another connection
// of db, whether the transaction committed (its id was read with the
// check): nil if it did, and if it did not, the transaction runs again like
// the cases above (the last such failure is ErrNotCommitted). A transaction
// the server still has in progress a second later (its client gone without
// the server knowing) has its backend ended first, so that the answer is
// known. RunTx asks within ctx (and at most 5s): it returns by ctx's
// deadline whatever the network does. ErrOutcomeUnknown, an
// *UnknownOutcomeError whose Resolve asks again later, is left for when the
// server cannot be asked in time: ctx ends first (a partition, a reply held
// past the deadline), db is a single connection or a transaction, or the
// server has failed over or restarted since. If fn returns an error, or ctx
// or the lease ends before COMMIT, the ROLLBACK is sent under ctx, and not
// at all once ctx has ended (the connection is then closed: the server
// rolls back a transaction whose connection is gone). (With db a
// transaction, RunTx runs a savepoint of it: nil then means the savepoint
// was released, and the outcome is that transaction's; a savepoint that
// could not be rolled back has its connection closed, so that the
// enclosing transaction cannot commit it.)
func (g Guard) RunTx(ctx context.Context, db DB, fn func(tx pgx.Tx) error) error {
	if err := ctxcheck.NotNil(ctx, "fence: Guard.RunTx"); err != nil {
		return err
	}
	if err := g.validate(); err != nil {
		return err
	}
	return runTx(ctx, db, g.fence(true), fn)
}

// fence is the guard's check as the fence of a transaction: with id, of
// one RunTx commits.
func (g Guard) fence(id bool) *txFence {
	f := &txFence{
		args:      []any{g.Lease, int64(g.Token)},
		id:        id,
		translate: func(err error, tx pgx.Tx) error { return translateCheck(err, g, tx) },
		schema:    g.Schema,
		metrics:   g.metrics(),
	}
	if ms := g.idleMillis(); ms > 0 {
		f.bound = true
		f.args = append(f.args, ms)
	}
	f.sql = fenceSQL(g.Schema, "pgfence_check", f.id, f.bound)
	return f
}

// idleMillis is the idle bound the check sets, in milliseconds (0: none).
func (g Guard) idleMillis() int64 { return idleMillis(g.IdleTimeout, 0) }

// idleMillis turns an IdleTimeout into the statement's parameter by the one
// rule of Guard and Resource: def (the type's default; 0: none) for 0, none
// (0) for a negative value; at least 1 ms, and at most what the server
// accepts (INT_MAX ms, about 24.8 days).
func idleMillis(d, def time.Duration) int64 {
	switch {
	case d < 0:
		return 0
	case d == 0:
		d = def
	}
	if d == 0 {
		return 0
	}
	return min(max(d.Milliseconds(), 1), math.MaxInt32)
}

// Folded is a guard's check as an SQL expression, for a statement that
// carries its own fence (see Guard.Fold).
type Folded struct {
	// Expr performs the check where the statement evaluates it.
	Expr string
	// Args are the values of Expr's two parameters, to append after the
	// statement's own arguments.
	Args []any

	lease string
	token Token
}

// Err turns the errors the check raises in a statement built with the
// folded expression into this package's typed errors (a *StaleTokenError,
// ErrUnknownLease, ErrTokenNotIssued), and returns any other error, and nil,
// as it is.
func (f Folded) Err(err error) error {
	if err == nil {
		return nil
	}
	return translate(err, f.lease, f.token)
}

// Fold returns the guard's check as an SQL expression for a statement that
// already has n parameters ($1 to $n): the expression uses $n+1 and $n+2,
// and Folded.Args holds their values. It lets a single autocommitted
// statement carry its own fence, for one round trip in all:
//
//	f, err := g.Fold(2)
//	if err != nil {
//		return err // an invalid guard
//	}
//	_, err = pool.Exec(ctx, `UPDATE jobs SET state = $1 FROM (SELECT `+f.Expr+`) f WHERE id = $2`,
//		append([]any{state, id}, f.Args...)...)
//	err = f.Err(err) // a *StaleTokenError when no longer the holder
//
// The expression must be evaluated before the statement writes (a FROM
// subquery or a CTE referenced in FROM is), and the statement's transaction
// then holds the lease row's KEY SHARE lock until it commits. Fold returns
// the guard's validation error (the same as Check's), or an error for a
// negative n; it never returns an expression that cannot run.
func (g Guard) Fold(n int) (Folded, error) {
	if err := g.validate(); err != nil {
		return Folded{}, err
	}
	if n < 0 {
		return Folded{}, fmt.Errorf("fence: Fold: %d parameters", n)
	}
	return Folded{
		Expr:  fmt.Sprintf("%s($%d::text, $%d::bigint)", ident.Table(g.Schema, "pgfence_check"), n+1, n+2),
		Args:  []any{g.Lease, int64(g.Token)},
		lease: g.Lease,
		token: g.Token,
	}, nil
}

// Validate reports whether the guard's fields are usable (name, token >= 1,
// schema), with the same errors Check returns.
func (g Guard) Validate() error { return g.validate() }

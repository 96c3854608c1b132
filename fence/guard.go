package fence

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
)

// Guard fences writes with a lease's token. Used inside a transaction, it
// makes that transaction commit only if no token greater than Token has been
// issued for Lease by the time it commits.
//
// The check takes a FOR KEY SHARE lock on the lease row. A takeover locks the
// row FOR UPDATE before it raises the token, so it waits until the guarded
// transaction ends, while renewals of the current holder (which only move the
// expiry) are not blocked. A guarded transaction
// that stays open therefore delays a takeover: keep guarded transactions short,
// and bound them with statement_timeout / idle_in_transaction_session_timeout.
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
}

// DB is the database handle pgfence's functions take: *pgxpool.Pool,
// *pgx.Conn and pgx.Tx (a savepoint for Begin) all satisfy it. It is the one
// executor interface of pgfence's packages (fence, runner, migrations).
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// MaxAttempts is how many times RunTx runs a transaction that provably did
// not commit for a reason that can pass: a serialization failure (40001), a
// deadlock (40P01), or a connection lost before COMMIT was sent (a pooled
// connection the server terminated, 57P01).
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
	if tx == nil {
		return ErrNilTx
	}
	if err := g.validate(); err != nil {
		return err
	}
	var cur int64
	return g.check(ctx, tx, g.checkSQL(), &cur)
}

// check runs a check statement (checkSQL or checkTxSQL) into dest.
func (g Guard) check(ctx context.Context, tx pgx.Tx, sql string, dest ...any) error {
	start := time.Now()
	err := tx.QueryRow(ctx, sql, g.Lease, int64(g.Token)).Scan(dest...)
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
	if tx == nil {
		return pgconn.CommandTag{}, ErrNilTx
	}
	if err := g.validate(); err != nil {
		return pgconn.CommandTag{}, err
	}
	// The same pipelining RunTx gives its function's first statement.
	tag, err := (&guardedTx{Tx: tx, g: g}).Exec(ctx, sql, args...)
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
// If the transaction provably did not commit for a passing reason (40001,
// 40P01, or the connection lost before COMMIT was sent), the whole
// transaction, fn included, runs again, up to MaxAttempts times: fn must not
// have effects outside the transaction. When the connection is lost during
// COMMIT, RunTx asks the server, on another connection of db, whether the
// transaction committed (its id was read with the check): nil if it did,
// and if it did not, the transaction runs again like the cases above (the
// last such failure is ErrNotCommitted). ErrOutcomeUnknown is left for when
// the server cannot be asked: db is a single connection or a transaction,
// the server does not answer within wait.CleanupTimeout (5s), or it has
// failed over since.
func (g Guard) RunTx(ctx context.Context, db DB, fn func(tx pgx.Tx) error) error {
	if err := g.validate(); err != nil {
		return err
	}
	if db == nil {
		return errors.New("fence: nil database handle")
	}
	if fn == nil {
		return errors.New("fence: nil function")
	}
	var err error
	for attempt := 1; attempt <= MaxAttempts; attempt++ {
		var committing bool
		committing, err = g.runOnce(ctx, db, fn)
		if !retryable(err, committing) || ctx.Err() != nil {
			break
		}
	}
	g.metrics().outcome(ctx, err, true)
	return err
}

// runOnce runs one attempt; committing reports that COMMIT was sent (its
// error, if any, is final).
func (g Guard) runOnce(ctx context.Context, db DB, fn func(tx pgx.Tx) error) (committing bool, err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() {
		if err != nil && !committing {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	gtx := &guardedTx{Tx: tx, g: g, bound: ctx}
	if err := fn(gtx); err != nil {
		return false, err
	}
	if err := gtx.ensure(ctx); err != nil {
		return false, err
	}
	return true, g.commit(ctx, db, gtx)
}

// commit classifies a failed COMMIT (aborted): when the server answered
// COMMIT with an error or a rollback, or the request was never sent, the
// transaction did not commit. Otherwise (the connection broke while COMMIT
// was in flight, or the server ended the session: a FATAL error can follow
// a commit that went through) the server is asked on another connection
// what became of the transaction (resolve).
func (g Guard) commit(ctx context.Context, db DB, t *guardedTx) error {
	err := t.Tx.Commit(ctx)
	if err == nil || aborted(err) {
		return err
	}
	return g.resolve(ctx, db, t, err)
}

// aborted reports a failed COMMIT that certainly did not commit: the server
// refused it with an ERROR (a serialization failure, a deferred constraint),
// answered ROLLBACK, or never got it. A FATAL or PANIC (the session
// terminated, the server shutting down) is not one: it can arrive after the
// commit record was written, before the reply was sent.
func aborted(err error) bool {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		sev := pg.SeverityUnlocalized
		if sev == "" {
			sev = pg.Severity
		}
		return sev != "FATAL" && sev != "PANIC"
	}
	return errors.Is(err, pgx.ErrTxCommitRollback) || pgconn.SafeToRetry(err)
}

// resolvePoll is how often resolve asks again while the server still has
// the transaction in progress (its COMMIT not yet done).
const resolvePoll = 20 * time.Millisecond

// resolve finds out from the server whether the transaction whose COMMIT
// reply was lost (cause) committed: pg_xact_status of its id, read in the
// first round trip, on another connection of db (a pool; a single
// connection broke with the COMMIT, and cannot be asked). It returns nil if
// the transaction committed, ErrNotCommitted if it aborted, and
// ErrOutcomeUnknown when the server cannot be asked within
// wait.CleanupTimeout, or is no longer the one the transaction ran on (its
// timeline changed: a promoted standby's transaction ids are not the old
// primary's).
func (g Guard) resolve(ctx context.Context, db DB, t *guardedTx, cause error) error {
	unknown := func(why string) error { return fmt.Errorf("%w: %w (%s)", ErrOutcomeUnknown, cause, why) }
	if t.xid == "" {
		return unknown("the transaction's id was not read")
	}
	if c, isConn := db.(*pgx.Conn); isConn && c.IsClosed() {
		return unknown("its connection is closed and there is no other to ask the server on")
	}
	if _, isTx := db.(pgx.Tx); isTx {
		return unknown("a savepoint of a transaction whose connection broke: the outcome is that transaction's")
	}
	ctx, cancel := wait.Detached(ctx)
	defer cancel()
	again := retry.Backoff{Base: resolvePoll, Max: time.Second}
	for n := 0; ; n++ {
		var (
			status   *string
			timeline int64
		)
		err := db.QueryRow(ctx, g.xactStatusSQL(), t.xid).Scan(&status, &timeline)
		switch {
		case err != nil && retry.Transient(err) && wait.Sleep(ctx, again.Wait(n)):
			continue // the server restarting, a failover: ask again
		case err != nil:
			return unknown("asking the server failed: " + err.Error())
		case timeline != t.timeline:
			return unknown(fmt.Sprintf("the server changed timeline (%d, then %d) before it could be asked", t.timeline, timeline))
		case status == nil:
			return unknown("the server no longer knows the transaction")
		case *status == "committed":
			return nil
		case *status == "aborted":
			return fmt.Errorf("%w: %w (the server reports transaction %s aborted)", ErrNotCommitted, cause, t.xid)
		}
		if !wait.Sleep(ctx, resolvePoll) { // "in progress": the COMMIT is not done yet
			return unknown("the server still had the transaction in progress")
		}
	}
}

// retryable reports a failure that provably left nothing committed and can
// pass: a definite abort (40001, 40P01, before or at COMMIT), or a lost
// connection before COMMIT was sent (one lost during COMMIT leaves the
// outcome unknown).
func retryable(err error, committing bool) bool {
	var pg *pgconn.PgError
	if errors.As(err, &pg) && (pg.Code == "40001" || pg.Code == "40P01") {
		return true
	}
	return !committing && retry.ConnectionLost(err) || errors.Is(err, ErrNotCommitted)
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

package runner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
)

// A leadership term's fenced statements, and running one slot: claim it,
// call the job, record the outcome in the ledger.

// term is one leadership term of a worker: the lease and the ledger
// statements with the lease's fence folded in, built once when the term
// starts.
type term struct {
	lease                            *lock.Lease
	claimFirst, claim, succeed, fail string
	fold                             fence.Folded // its Args follow each statement's own
}

// newTerm builds the term's fenced statements.
func (w *worker) newTerm(l *lock.Lease) (*term, error) {
	g := l.Guard()
	t := &term{lease: l}
	for _, st := range []struct {
		sql   *string
		n     int
		build func(fence string) string
	}{{&t.claimFirst, 5, w.r.q.claimFirst}, {&t.claim, 7, w.r.q.claim}, {&t.succeed, 6, w.r.q.succeedFenced}, {&t.fail, 8, w.r.q.fail}} {
		f, err := g.Fold(st.n)
		if err != nil {
			return nil, err
		}
		*st.sql, t.fold = st.build(f.Expr), f
	}
	return t, nil
}

// args are a statement's own arguments followed by the fold's.
func (t *term) args(own ...any) []any { return append(own, t.fold.Args...) }

// runSlot claims slot and runs it, with retries, while the lease holds.
func (w *worker) runSlot(ctx context.Context, t *term, slot slotRef) {
	l := t.lease
	again := retry.Backoff{Base: w.r.lcfg.PollInterval, Max: 10 * w.r.lcfg.PollInterval}
	var failing retry.Failing
	for ctx.Err() == nil {
		attempt, status, err := w.claim(ctx, t, slot)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, fence.ErrFenced) {
				return
			}
			if permanent(err) {
				w.r.fatal(fmt.Errorf("runner: job %q: claim %s slot %s: %w", w.j.Name, slot.kind, slot.at.Format(time.RFC3339Nano), err))
				return
			}
			failing.Fail(w.log(), "pgfence runner: claims failing; retrying", err, "slot", slot.at, "kind", slot.kind)
			wait.Sleep(ctx, again.Wait(failing.Count()-1))
			continue
		}
		failing.Recover(w.log(), "pgfence runner: claims recovered", "slot", slot.at, "kind", slot.kind)
		switch status {
		case "":
			// Already finished (by this replica or another: a takeover
			// claims the last slot again), or out of attempts: not a run
			// of this replica's, so not counted.
			return
		case StatusSkipped:
			w.r.m.skipped(w.j.Name)
			w.event(RunSkipped, slot, l, attempt, nil)
			return
		}
		run := &Run{Job: w.j.Name, Shard: w.shard, Shards: w.j.shards, Slot: slot.at, Manual: slot.kind == KindManual,
			Attempt: attempt, Token: l.Token(), w: w, lease: l}
		w.runStart = w.r.clock.Now()
		w.event(RunStarted, slot, l, attempt, nil)
		err = w.call(ctx, run)
		if !w.finish(ctx, t, run, err) {
			return
		}
		if !wait.Sleep(ctx, w.j.Retry.wait(attempt)) {
			return
		}
	}
}

// ref is the run's slot.
func (r *Run) ref() slotRef {
	if r.Manual {
		return slotRef{KindManual, r.Slot}
	}
	return scheduled(r.Slot)
}

// key is the ledger row of the run's attempt: job, shard, kind, slot,
// attempt, token.
func (r *Run) key() []any {
	return []any{r.Job, r.Shard, string(r.ref().kind), r.Slot, r.Attempt, int64(r.Token)}
}

// finish records the attempt's outcome and reports whether to retry.
func (w *worker) finish(ctx context.Context, t *term, run *Run, runErr error) (retry bool) {
	l, slot, attempt := t.lease, run.ref(), run.Attempt
	succeeded := func() bool {
		if runErr != nil {
			w.log().Warn("pgfence runner: the job returned an error after its CommitTx committed; the slot succeeded",
				"slot", slot.at, "kind", slot.kind, "attempt", attempt, "token", l.Token(), "err", runErr)
		}
		if w.failures > 0 {
			w.log().Info("pgfence runner: the job succeeded again", "slot", slot.at, "after_failures", w.failures)
			w.failures = 0
		}
		w.event(RunSucceeded, slot, l, attempt, nil)
		return false
	}
	if run.committed {
		return succeeded()
	}
	if l.Err() != nil || errors.Is(runErr, fence.ErrFenced) {
		// A CommitTx whose answer was lost as the lease ended may have
		// committed: the ledger says.
		rctx, cancel := wait.Detached(ctx)
		status, err := w.recorded(rctx, run, nil)
		cancel()
		if err == nil && status == StatusSucceeded {
			return succeeded()
		}
		w.fenced(l, run, firstErr(runErr, l.Err()))
		return false
	}
	if runErr != nil && errors.Is(context.Cause(ctx), errShutdown) {
		// Interrupted by shutdown with the lease still ours: leave the slot
		// "running"; the next leader's claim (with a greater token) runs it.
		return false
	}
	// A run that finished must have its outcome recorded even if shutdown
	// has begun; the folded fence, not the context, decides whether it may.
	ctx, cancel := wait.Detached(ctx)
	defer cancel()
	var (
		tag pgconn.CommandTag
		err error
	)
	status := StatusSucceeded
	if runErr == nil {
		tag, err = w.r.pool.Exec(ctx, t.succeed, t.args(run.key()...)...)
	} else {
		status = StatusFailed
		var p *panicError
		if errors.As(runErr, &p) {
			status = StatusPanicked
		}
		tag, err = w.r.pool.Exec(ctx, t.fail, t.args(append(run.key(), string(status), runErr.Error())...)...)
	}
	err = t.fold.Err(err)
	if err == nil && tag.RowsAffected() != 1 || err != nil && !errors.Is(err, fence.ErrFenced) {
		// The statement changed nothing (the attempt is no longer
		// running: its CommitTx committed, whatever the job returned, or
		// a newer leader took the slot over), or its answer was lost: the
		// ledger says which.
		status, err = w.recorded(ctx, run, err)
	}
	switch {
	case err == nil && status == StatusSucceeded:
		return succeeded()
	case err == nil && (status == StatusFailed || status == StatusPanicked):
		retry := attempt < w.j.Retry.MaxAttempts
		// ERROR at the 1st, 2nd, 4th, 8th... failure in a row, DEBUG in
		// between: a job that fails every slot does not flood the log, and
		// the count says how long it has.
		w.failures++
		level := slog.LevelDebug
		if w.failures&(w.failures-1) == 0 {
			level = slog.LevelError
		}
		w.log().Log(ctx, level, "pgfence runner: run failed", "slot", slot.at, "kind", slot.kind, "attempt", attempt, "token", l.Token(),
			"status", status, "retry", retry, "consecutive_failures", w.failures, "err", runErr)
		w.event(RunFailed, slot, l, attempt, runErr)
		return retry
	case err == nil:
		err = ErrFenced // fenced by a newer leader
	}
	if errors.Is(err, fence.ErrFenced) || l.Err() != nil {
		w.fenced(l, run, err)
		return false
	}
	w.log().Warn("pgfence runner: recording the outcome failed; the next leader will rerun the slot",
		"slot", slot.at, "kind", slot.kind, "attempt", attempt, "token", l.Token(), "err", err)
	return false
}

// recorded reads what the ledger holds for run's attempt, after the
// statement recording its outcome changed nothing or failed with cause. A
// status other than succeeded, failed or panicked (running, fenced) is
// returned as ErrFenced if the statement changed nothing, and as cause if
// it failed: the outcome is not recorded.
func (w *worker) recorded(ctx context.Context, run *Run, cause error) (Status, error) {
	var status Status
	if err := w.r.pool.QueryRow(ctx, w.r.q.outcome, run.key()...).Scan(&status); err != nil {
		return "", firstErr(cause, err)
	}
	switch status {
	case StatusSucceeded, StatusFailed, StatusPanicked:
		return status, nil
	}
	return "", firstErr(cause, ErrFenced)
}

// fenced marks this attempt's own row as fenced (only if it is still
// running under this token) and reports the event.
func (w *worker) fenced(l *lock.Lease, run *Run, cause error) {
	ctx, cancel := wait.Detached(context.Background())
	defer cancel()
	msg := "fenced"
	if cause != nil {
		msg = cause.Error()
	}
	if _, err := w.r.pool.Exec(ctx, w.r.q.markFenced, append(run.key(), msg)...); err != nil {
		// The next leader's claim marks it fenced anyway.
		w.log().Debug("pgfence runner: could not mark the attempt fenced; the next claim will", "slot", run.Slot, "err", err)
	}
	w.log().Warn("pgfence runner: run fenced: a newer holder took over; its writes are refused",
		"slot", run.Slot, "manual", run.Manual, "attempt", run.Attempt, "token", l.Token(), "err", cause)
	w.event(RunFenced, run.ref(), l, run.Attempt, cause)
}

// claim starts an attempt at slot in an autocommitted, fenced statement:
// claimFirst for a scheduled slot's first attempt (the common case), else,
// or when that finds the slot claimed or the job paused, the full claim.
// status is "" when the slot is finished (or out of attempts), else
// running or skipped (the job is paused).
func (w *worker) claim(ctx context.Context, t *term, slot slotRef) (attempt int, status Status, err error) {
	l := t.lease
	if err := l.Err(); err != nil {
		return 0, "", err
	}
	if slot.kind == KindScheduled {
		err = w.r.pool.QueryRow(ctx, t.claimFirst, t.args(w.j.Name, w.shard, slot.at, int64(l.Token()), w.r.lcfg.Holder)...).Scan(&attempt)
		if err == nil {
			return attempt, StatusRunning, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, "", t.fold.Err(err)
		}
	}
	err = w.r.pool.QueryRow(ctx, t.claim, t.args(w.j.Name, w.shard, string(slot.kind), slot.at, int64(l.Token()),
		w.r.lcfg.Holder, w.j.Retry.MaxAttempts)...).Scan(&attempt, &status)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, "", nil
	}
	return attempt, status, t.fold.Err(err)
}

// call runs the job function with its timeout, turning a panic into a
// *panicError.
func (w *worker) call(ctx context.Context, run *Run) (err error) {
	if w.j.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, w.j.Timeout)
		defer cancel()
	}
	defer func() {
		if p := recover(); p != nil {
			err = &panicError{job: w.j.Name, value: p, stack: debug.Stack()}
		}
	}()
	w.user(func() { err = w.j.Run(ctx, run) })
	return err
}

// panicError is a job's panic, recorded with status panicked.
type panicError struct {
	job   string
	value any
	stack []byte
}

func (p *panicError) Error() string {
	return fmt.Sprintf("runner: job %q panicked: %v\n%s", p.job, p.value, p.stack)
}

func (r *Runner) recordSuccess(ctx context.Context, tx pgx.Tx, run *Run) error {
	tag, err := tx.Exec(ctx, r.q.succeed, run.key()...)
	if err != nil {
		return err
	}
	if tag.RowsAffected() != 1 {
		return ErrFenced
	}
	return nil
}

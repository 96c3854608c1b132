package runner

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
)

// worker campaigns for one job's (or shard's) lease and, while it leads,
// runs the job's slots.
type worker struct {
	r     *Runner
	j     *job
	shard int

	// The ledger statements with the current term's fence folded in,
	// built once per term (see lead).
	claimSQL, succeedSQL, failSQL string
	fenceArgs                     []any
}

func (w *worker) leaseName() string {
	if w.j.shards == 0 {
		return "pgfence/job/" + w.j.Name
	}
	return "pgfence/job/" + w.j.Name + "/" + strconv.Itoa(w.shard)
}

func (w *worker) event(k EventKind, slot time.Time, l *lock.Lease, attempt int, err error) {
	e := Event{Kind: k, Job: w.j.Name, Shard: w.shard, Slot: slot, Attempt: attempt, Err: err}
	if l != nil {
		e.Token = l.Token()
	}
	w.r.emit(e)
}

// loop campaigns, leads, releases and campaigns again until ctx ends.
func (w *worker) loop(ctx context.Context) {
	log := w.r.cfg.Logger.With("job", w.j.Name, "shard", w.shard)
	for ctx.Err() == nil {
		l, err := w.r.lc.Acquire(ctx, w.leaseName())
		if err != nil {
			// Acquire retries transient errors itself: what it returns
			// is the end of ctx, or permanent.
			if ctx.Err() == nil && !errors.Is(err, lock.ErrClosed) {
				w.r.fatal(fmt.Errorf("runner: job %q: %w", w.j.Name, err))
			}
			return
		}
		log.Info("pgfence runner: leading", "token", l.Token())
		w.event(LeadershipGained, time.Time{}, l, 0, nil)
		err = w.lead(ctx, l)
		// Nothing runs under the lease any more: say so before the
		// release, which may take a while if the database is unreachable.
		w.event(LeadershipLost, time.Time{}, l, 0, err)
		_ = l.Release(ctx) // bounded by its own timeout once ctx has ended
		if permanent(err) {
			w.r.fatal(fmt.Errorf("runner: job %q: %w", w.j.Name, err))
			return
		}
	}
}

// lead runs slots while l is held and ctx lives, and returns why it stopped.
func (w *worker) lead(ctx context.Context, l *lock.Lease) error {
	lctx, cancel := context.WithCancelCause(l.Context())
	defer cancel(nil)
	stop := context.AfterFunc(ctx, func() { cancel(context.Cause(ctx)) })
	defer stop()
	w.foldFence(l)

	// Taking over: finish the last slot if it was left unfinished (its
	// runner died or paused), then the latest missed slot, by policy.
	var last *time.Time
	if err := w.r.pool.QueryRow(lctx, w.r.q.lastSlot, w.j.Name, w.shard).Scan(&last); err != nil {
		return err
	}
	now := time.Now()
	if last != nil {
		w.runSlot(lctx, l, *last)
		if due := latestDue(w.j.sched, *last, now); !due.IsZero() &&
			(w.j.Missed == RunLatest || now.Sub(due) < time.Second) {
			w.runSlot(lctx, l, due)
		}
	}
	cursor := now
	for {
		next := w.j.sched.Next(cursor)
		if !sleepUntil(lctx, next) {
			return context.Cause(lctx)
		}
		// Slots that passed while the previous run was still going are
		// not queued up: the latest due one runs.
		slot := next
		if due := latestDue(w.j.sched, next, time.Now()); !due.IsZero() {
			slot = due
		}
		w.runSlot(lctx, l, slot)
		cursor = slot
		if lctx.Err() != nil {
			return context.Cause(lctx)
		}
	}
}

// runSlot claims slot and runs it, with retries, while the lease holds.
func (w *worker) runSlot(ctx context.Context, l *lock.Lease, slot time.Time) {
	for ctx.Err() == nil {
		attempt, claimed, err := w.claim(ctx, l, slot)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, fence.ErrFenced) {
				return
			}
			if permanent(err) {
				w.r.fatal(fmt.Errorf("runner: job %q: claim slot %s: %w", w.j.Name, slot.Format(time.RFC3339), err))
				return
			}
			w.r.cfg.Logger.Warn("pgfence runner: claim failed", "job", w.j.Name, "slot", slot, "err", err)
			wait.Sleep(ctx, w.r.cfg.PollInterval)
			continue
		}
		if !claimed {
			return // already succeeded, or out of attempts
		}
		run := &Run{Job: w.j.Name, Shard: w.shard, Shards: w.j.shards, Slot: slot, Attempt: attempt, Token: l.Token(), w: w, lease: l}
		w.event(RunStarted, slot, l, attempt, nil)
		err = w.call(ctx, run)
		if !w.finish(ctx, l, run, err) {
			return
		}
		if !wait.Sleep(ctx, w.j.Retry.wait(attempt)) {
			return
		}
	}
}

// finish records the attempt's outcome and reports whether to retry.
func (w *worker) finish(ctx context.Context, l *lock.Lease, run *Run, runErr error) (retry bool) {
	slot, attempt := run.Slot, run.Attempt
	if runErr == nil && run.committed {
		w.event(RunSucceeded, slot, l, attempt, nil)
		return false
	}
	if l.Err() != nil || errors.Is(runErr, fence.ErrStaleToken) || errors.Is(runErr, ErrFenced) {
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
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), wait.CleanupTimeout)
	defer cancel()
	g := l.Guard()
	args := append([]any{w.j.Name, w.shard, slot, int64(l.Token())}, w.fenceArgs...)
	var err error
	if runErr == nil {
		var tag pgconn.CommandTag
		tag, err = w.r.pool.Exec(ctx, w.succeedSQL, args...)
		if err = g.Err(err); err == nil && tag.RowsAffected() != 1 {
			err = ErrFenced
		}
		if err == nil {
			w.event(RunSucceeded, slot, l, attempt, nil)
			return false
		}
	} else {
		_, err = w.r.pool.Exec(ctx, w.failSQL, append(args, runErr.Error())...)
		if err = g.Err(err); err == nil {
			w.event(RunFailed, slot, l, attempt, runErr)
			return attempt < w.j.Retry.MaxAttempts
		}
	}
	if errors.Is(err, fence.ErrStaleToken) || errors.Is(err, ErrFenced) || l.Err() != nil {
		w.fenced(l, run, err)
		return false
	}
	w.r.cfg.Logger.Warn("pgfence runner: recording the outcome failed; the next leader will rerun the slot",
		"job", w.j.Name, "slot", slot, "err", err)
	return false
}

// fenced marks this attempt's own row as fenced (only if no newer attempt has
// claimed it) and reports the event.
func (w *worker) fenced(l *lock.Lease, run *Run, cause error) {
	ctx, cancel := context.WithTimeout(context.Background(), wait.CleanupTimeout)
	defer cancel()
	msg := "fenced"
	if cause != nil {
		msg = cause.Error()
	}
	_, _ = w.r.pool.Exec(ctx, w.r.q.markFenced, w.j.Name, w.shard, run.Slot, int64(l.Token()), msg)
	w.event(RunFenced, run.Slot, l, run.Attempt, cause)
}

// claim claims slot in one autocommitted, fenced statement.
func (w *worker) claim(ctx context.Context, l *lock.Lease, slot time.Time) (attempt int, claimed bool, err error) {
	if err := l.Err(); err != nil {
		return 0, false, err
	}
	err = w.r.pool.QueryRow(ctx, w.claimSQL, append([]any{w.j.Name, w.shard, slot, int64(l.Token()),
		w.r.cfg.Instance, w.j.Retry.MaxAttempts}, w.fenceArgs...)...).Scan(&attempt)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	return attempt, err == nil, l.Guard().Err(err)
}

// foldFence builds the term's fenced ledger statements. The fold expression
// takes the same two arguments in every statement, so each statement puts
// them right after its own parameters: claim has six, the others four
// (fail's error message comes last, as $7).
func (w *worker) foldFence(l *lock.Lease) {
	g := l.Guard()
	claimExpr, args := g.Fold(7)
	outcomeExpr, _ := g.Fold(5)
	w.claimSQL = fmt.Sprintf(w.r.q.claim, claimExpr)
	w.succeedSQL = fmt.Sprintf(w.r.q.succeedFenced, outcomeExpr)
	w.failSQL = fmt.Sprintf(w.r.q.fail, outcomeExpr)
	w.fenceArgs = args
}

// call runs the job function with its timeout, turning a panic into an error.
func (w *worker) call(ctx context.Context, run *Run) (err error) {
	if w.j.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, w.j.Timeout)
		defer cancel()
	}
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("runner: job %q panicked: %v\n%s", w.j.Name, p, debug.Stack())
		}
	}()
	return w.j.Run(ctx, run)
}

func (r *Runner) recordSuccess(ctx context.Context, tx pgx.Tx, run *Run) error {
	tag, err := tx.Exec(ctx, r.q.succeed, run.Job, run.Shard, run.Slot, int64(run.Token))
	if err != nil {
		return err
	}
	if tag.RowsAffected() != 1 {
		return ErrFenced
	}
	return nil
}

// latestDue returns the latest slot in (after, now], or the zero time.
func latestDue(s Schedule, after, now time.Time) time.Time {
	if e, ok := s.(every); ok {
		due := e.floor(now)
		if due.After(after) {
			return due
		}
		return time.Time{}
	}
	var due time.Time
	for t, i := s.Next(after), 0; !t.IsZero() && !t.After(now) && i < 1_000_000; t, i = s.Next(t), i+1 {
		due = t
	}
	return due
}

func firstErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

func sleepUntil(ctx context.Context, t time.Time) bool { return wait.Sleep(ctx, time.Until(t)) }

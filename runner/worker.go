package runner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/lock"
)

// worker campaigns for one job's (or shard's) lease through lock.Election
// and, while it leads, runs the job's slots.
type worker struct {
	r     *Runner
	j     *job
	shard int

	runStart time.Time // of the attempt under way, for its duration
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
	w.r.m.event(e, w.r.clock.Now().Sub(w.runStart))
	w.r.emit(e)
}

// loop campaigns, leads, releases and campaigns again until ctx ends, with
// lock.Election. A permanent error stops the whole runner.
func (w *worker) loop(ctx context.Context) {
	log := w.log()
	e := &lock.Election{
		Client: w.r.lc,
		Name:   w.leaseName(),
		Lead: func(ctx context.Context, l *lock.Lease) error {
			defer w.r.hold(l)()
			log.Info("pgfence runner: leading", "token", l.Token())
			w.event(LeadershipGained, time.Time{}, l, 0, nil)
			return w.lead(ctx, l)
		},
		OnStop: func(l *lock.Lease, err error) {
			w.event(LeadershipLost, time.Time{}, l, 0, err)
			if permanent(err) {
				w.r.fatal(fmt.Errorf("runner: job %q: %w", w.j.Name, err))
			}
		},
		RetryDelay: -1, // a lost lease is campaigned for again at once
	}
	if err := e.Run(ctx); err != nil && !errors.Is(err, lock.ErrClosed) {
		// Acquire retries transient errors itself: this is permanent.
		w.r.fatal(fmt.Errorf("runner: job %q: %w", w.j.Name, err))
	}
}

// log is the runner's logger with the worker's job and shard.
func (w *worker) log() *slog.Logger { return w.r.log.With("job", w.j.Name, "shard", w.shard) }

// lead runs slots while ctx (which ends with the lease) lives, and returns
// why it stopped.
func (w *worker) lead(ctx context.Context, l *lock.Lease) error {
	t, err := w.newTerm(l)
	if err != nil {
		return err
	}
	// Taking over: finish the last slot if it was left unfinished (its
	// runner died or paused), then the latest missed slot, by policy.
	var last *time.Time
	if err := w.r.pool.QueryRow(ctx, w.r.q.lastSlot, w.j.Name, w.shard).Scan(&last); err != nil {
		return err
	}
	now := w.r.clock.Now()
	if last != nil {
		w.runSlot(ctx, t, *last) // the claim runs it only if it is unfinished
		run, unrun := catchUp(w.j.sched, w.j.Missed, *last, now)
		w.r.m.missedSlots(w.j.Name, unrun)
		for _, slot := range run {
			w.runSlot(ctx, t, slot)
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
		}
		if len(run) > 0 {
			now = run[len(run)-1]
		}
	}
	cursor := now
	for {
		next := w.j.sched.Next(cursor)
		if !clock.Sleep(ctx, w.r.clock, next.Sub(w.r.clock.Now())) {
			return context.Cause(ctx)
		}
		// Slots that passed while the previous run was still going are
		// not queued up: the latest due one runs.
		slot, missed := overrun(w.j.sched, next, w.r.clock.Now())
		w.r.m.missedSlots(w.j.Name, missed)
		w.runSlot(ctx, t, slot)
		cursor = slot
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
	}
}

func firstErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

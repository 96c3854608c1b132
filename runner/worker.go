package runner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
)

// worker campaigns for one job's (or shard's) lease through lock.Election
// and, while it leads, runs the job's slots.
type worker struct {
	r     *Runner
	j     *job
	shard int

	runStart time.Time    // of the attempt under way, for its duration
	failures int          // attempts failed in a row (for the log's pace)
	calls    atomic.Int32 // the application's functions running now (user): Run's StopError names them
}

func (w *worker) leaseName() string {
	if w.j.group != nil {
		return groupLeasePrefix + w.j.Name + "/" + strconv.Itoa(w.shard)
	}
	if w.j.shards == 0 {
		return jobLeasePrefix + w.j.Name
	}
	return jobLeasePrefix + w.j.Name + "/" + strconv.Itoa(w.shard)
}

func (w *worker) event(k EventKind, s slotRef, l *lock.Lease, attempt int, err error) {
	e := Event{Kind: k, Job: w.j.Name, Shard: w.shard, Slot: s.at, Manual: s.kind == KindManual, Attempt: attempt, Err: err}
	if l != nil {
		e.Token = l.Token()
	}
	w.r.m.event(e, w.r.clock.Now().Sub(w.runStart))
	w.user(func() { w.r.emit(e) })
}

// user runs f, the application's code under the worker's term (a job's
// function, a group's Consume or End, OnEvent), counted in calls.
func (w *worker) user(f func()) {
	w.calls.Add(1)
	defer w.calls.Add(-1)
	f()
}

// loop campaigns, leads, releases and campaigns again until ctx ends, with
// lock.Election. A permanent error stops the whole runner.
func (w *worker) loop(ctx context.Context) {
	w.electionEnded(w.election(w.lead).Run(ctx))
}

// election campaigns for the worker's lease and calls lead while it holds
// it, recording the term (for shutdown and for the events and metrics).
func (w *worker) election(lead func(ctx context.Context, l *lock.Lease) error) *lock.Election {
	log := w.log()
	var ended error // why the term that just ran ended, for OnStop (the election runs one term at a time)
	e := &lock.Election{
		Client: w.r.lc,
		Name:   w.leaseName(),
		Lead: func(ctx context.Context, l *lock.Lease) error {
			defer w.r.hold(w, l)()
			prev := w.startTerm(l)
			if prev.holder == "" {
				log.Info("pgfence runner: leading", "token", l.Token())
			} else {
				log.Info("pgfence runner: leading", "token", l.Token(), "previous_holder", prev.holder,
					"previous_token", prev.token, "previous_end", prev.cause)
			}
			w.event(LeadershipGained, slotRef{}, l, 0, nil)
			err := lead(ctx, l)
			// The term is closed before the election releases the lease,
			// so that the next leader finds it closed with its cause.
			ended = whyEnded(ctx, l, err)
			w.endTerm(context.Background(), l, termCause(ended))
			return err
		},
		OnStop: func(l *lock.Lease, err error) {
			if ended != nil {
				err, ended = ended, nil
			}
			w.event(LeadershipLost, slotRef{}, l, 0, err)
			if why, ok := termEnd(err); ok {
				log.Info("pgfence runner: stopped leading", "token", l.Token(), "why", why)
			} else {
				log.Warn("pgfence runner: stopped leading", "token", l.Token(), "why", why, "err", err)
			}
			if permanent(err) {
				w.r.fatal(fmt.Errorf("runner: job %q: %w", w.j.Name, err))
			}
		},
		RetryDelay: -1, // a lost lease is campaigned for again at once
	}
	return e
}

// singleLoop is a singleton job's worker: it campaigns for the job's lease
// only while this replica is the job's preferred one, so that a fleet of N
// replicas keeps one campaigner per job, not N (each waiting campaigner
// costs a share of its client's polls). A term, once begun, runs on when
// the preference moves away: lead hands the job over between runs (see
// handOver), and then the campaign stops until the job is this replica's
// again. A crashed leader's job is taken over by its next preferred
// replica once the balancer sees the crashed instance gone (its liveness
// row expires within a TTL, and the balancer looks again as it does) and
// the lease expires.
func (w *worker) singleLoop(ctx context.Context) {
	for ctx.Err() == nil {
		mine, changed := w.r.pref.get(w.j.Name)
		if !mine {
			select {
			case <-changed:
				continue
			case <-ctx.Done():
				return
			}
		}
		if err := w.campaign(ctx); err != nil {
			return // the client is closed, or the runner stops on a permanent error
		}
	}
}

// campaign runs the job's election while this replica is preferred for it:
// a campaign (a waiting Acquire) is cancelled as soon as the preference
// moves away, a term is not (it ends at its next hand-over point). It
// returns the election's error: lock.ErrClosed once the client is closed,
// or a permanent error (which has stopped the runner).
func (w *worker) campaign(ctx context.Context) error {
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu      sync.Mutex
		leading bool
	)
	// stopIfNotMine ends the campaign if the job is no longer this
	// replica's and no term runs.
	stopIfNotMine := func() {
		mu.Lock()
		defer mu.Unlock()
		if mine, _ := w.r.pref.get(w.j.Name); !mine && !leading {
			cancel()
		}
	}
	e := w.election(func(ctx context.Context, l *lock.Lease) error {
		mu.Lock()
		leading = true
		mu.Unlock()
		defer w.watchStuck(ctx)()
		err := w.lead(ctx, l)
		mu.Lock()
		leading = false
		mu.Unlock()
		stopIfNotMine() // handed over: campaign again only once it is ours
		return err
	})
	watch := bg.Run(cctx, func(cctx context.Context) {
		for {
			_, changed := w.r.pref.get(w.j.Name)
			stopIfNotMine()
			select {
			case <-changed:
			case <-cctx.Done():
				return
			}
		}
	})
	err := e.Run(cctx)
	w.electionEnded(err)
	cancel()
	watch.Stop()
	return err
}

// electionEnded handles the end of the worker's election: an error other
// than a closed client is permanent (Acquire retries transient errors
// itself) and stops the runner.
func (w *worker) electionEnded(err error) {
	if err != nil && !errors.Is(err, lock.ErrClosed) {
		w.r.fatal(fmt.Errorf("runner: job %q: %w", w.j.Name, err))
	}
}

// log is the runner's logger (with the instance: holder) with the worker's
// job and shard, or group and partition.
func (w *worker) log() *slog.Logger {
	if w.j.group != nil {
		return w.r.log.With("group", w.j.Name, "partition", w.shard)
	}
	return w.r.log.With("job", w.j.Name, "shard", w.shard)
}

// whyEnded says why a term ended: what lead returned, unless that is nil
// or a bare cancellation and the term's context says more (the lease's
// loss, a shutdown, a move), or the lease's loss when lead returned nil.
func whyEnded(ctx context.Context, l *lock.Lease, err error) error {
	if (err == nil || errors.Is(err, context.Canceled)) && ctx.Err() != nil {
		err = context.Cause(ctx)
	}
	if lost := l.Err(); err == nil && lost != nil && !errors.Is(lost, lock.ErrReleased) {
		err = lost
	}
	return err
}

// errMoved ends a partition's term when a rebalance moves the partition to
// another replica.
var errMoved = errors.New("runner: moved to another replica by a rebalance")

// termEnd says why a term ended (what Lead returned, or the lease's loss),
// and whether that is an ordinary end (released, moved, handed over, shut
// down) rather than a loss or a failure.
func termEnd(err error) (why string, ordinary bool) {
	c := termCause(err)
	return termWhy[c], c != EndLeaseLost && c != EndFailed
}

// termWhy says each cause of a term's end (Term.EndCause) in words.
var termWhy = map[string]string{
	EndReleased:   "released",
	EndMoved:      "moved to another replica by a rebalance",
	EndHandedOver: "handed over to its preferred replica",
	EndShutdown:   "its replica shut down",
	EndLeaseLost:  "lease lost (a renewal refused or too late)",
	EndFailed:     "failed",
	EndExpired:    "expired: its leader did not end it (killed, frozen past its lease, or cut off)",
	EndRevoked:    "revoked (a seek, or a change of the partition count)",
}

// termCause is the cause of a term's end.
func termCause(err error) string {
	switch {
	case err == nil, errors.Is(err, lock.ErrReleased):
		return EndReleased
	case errors.Is(err, errMoved):
		return EndMoved
	case errors.Is(err, errHandOver):
		return EndHandedOver
	case errors.Is(err, errShutdown):
		return EndShutdown
	case errors.Is(err, context.Canceled):
		// The balancer stopped this instance's worker: the job's shard (or
		// the partition) is another instance's now.
		return EndMoved
	case errors.Is(err, lock.ErrLeaseLost):
		return EndLeaseLost
	}
	return EndFailed
}

// slotRef names a slot of the worker's job and shard: a scheduled one, or
// a manual run.
type slotRef struct {
	kind Kind
	at   time.Time
}

func scheduled(at time.Time) slotRef { return slotRef{KindScheduled, at} }

// lead runs slots while ctx (which ends with the lease) lives, and returns
// why it stopped: on taking over, the last slot if it was left unfinished
// and the missed ones by policy; then each slot of the schedule, and the
// manual runs asked for, when woken.
func (w *worker) lead(ctx context.Context, l *lock.Lease) error {
	began := time.Now() // the term's age paces hand-overs: real clock (see handOver)
	t, err := w.newTerm(l)
	if err != nil {
		return err
	}
	// Watch before the first look at the ledger, so that no request
	// made after that look goes unannounced.
	wake, stopWatch := w.r.lc.Watch(wakeName(w.j.Name, w.j.shards, w.shard))
	defer stopWatch()
	poked, stopPokes := w.r.pokes.add(wakeName(w.j.Name, w.j.shards, w.shard))
	defer stopPokes()
	var last, succeeded *time.Time
	if err := w.r.pool.QueryRow(ctx, w.r.q.lastSlot, w.j.Name, w.shard).Scan(&last, &succeeded); err != nil {
		return err
	}
	if succeeded != nil {
		w.r.m.succeeded(w.j.Name, *succeeded)
	}
	now := w.r.clock.Now()
	if last != nil {
		w.runSlot(ctx, t, scheduled(*last)) // the claim runs it only if it is unfinished
		run, unrun := catchUp(w.j.sched, w.j.Missed, *last, now)
		w.r.m.missedSlots(w.j.Name, unrun)
		for _, slot := range run {
			w.runSlot(ctx, t, scheduled(slot))
			if ctx.Err() != nil {
				return context.Cause(ctx)
			}
		}
		if len(run) > 0 {
			now = run[len(run)-1]
		}
	}
	w.runRequested(ctx, t)
	cursor := now
	for {
		if w.handOver(began) {
			w.log().Info("pgfence runner: handing the job over to its preferred replica", "token", l.Token())
			return errHandOver
		}
		next := w.j.sched.Next(cursor)
		switch w.waitFor(ctx, next, wake, poked, began) {
		case leadEnded:
			return context.Cause(ctx)
		case woken:
			w.runRequested(ctx, t)
			continue
		case preferenceChanged:
			continue
		}
		// Slots that passed while the previous run was still going are
		// not queued up: the latest due one runs. They count as missed
		// only if no replica ran them (this one may have been frozen
		// while another led).
		slot, missed := overrun(w.j.sched, next, w.r.clock.Now())
		if missed > 0 {
			w.r.m.missedSlots(w.j.Name, w.unrun(ctx, next, slot, missed))
		}
		w.runSlot(ctx, t, scheduled(slot))
		cursor = slot
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
	}
}

// unrun returns how many of the missed scheduled slots in [from, to) no
// replica has an attempt at, by the ledger; if the ledger cannot be read,
// none (a counter of slots that did not run must not count slots that did).
func (w *worker) unrun(ctx context.Context, from, to time.Time, missed int) int {
	var ran int
	if err := w.r.pool.QueryRow(ctx, w.r.q.ranBetween, w.j.Name, w.shard, from, to).Scan(&ran); err != nil {
		return 0
	}
	return max(missed-ran, 0)
}

type waited int

const (
	slotDue           waited = iota // the slot's time came
	woken                           // a manual run was announced
	preferenceChanged               // a singleton job's preferred leader may have changed
	leadEnded                       // ctx ended
)

// waitFor waits on the runner's clock until slot, or until woken (by the
// notification of a manual run, or by the balancer finding one pending), the
// preference changes (or, for a term younger than handOverAfter, it comes
// of age), or ctx ends.
func (w *worker) waitFor(ctx context.Context, slot time.Time, wake, poked <-chan struct{}, began time.Time) waited {
	fired := make(chan struct{})
	timer := w.r.clock.AfterFunc(slot.Sub(w.r.clock.Now()), func() { close(fired) })
	defer timer.Stop()
	var prefer <-chan struct{}
	var ofAge <-chan time.Time
	if w.j.shards == 0 {
		var mine bool
		mine, prefer = w.r.pref.get(w.j.Name)
		if left := w.r.cfg.RebalanceInterval - time.Since(began); !mine && left > 0 {
			t := time.NewTimer(left) // pacing, so on the real clock
			defer t.Stop()
			ofAge = t.C
		}
	}
	select {
	case <-fired:
		return slotDue
	case <-wake:
		return woken
	case <-poked:
		return woken
	case <-prefer:
		return preferenceChanged
	case <-ofAge:
		return preferenceChanged
	case <-ctx.Done():
		return leadEnded
	}
}

// errHandOver ends a term whose singleton job another replica should lead.
var errHandOver = errors.New("runner: handing the job over to its preferred replica")

// handOver reports whether this term (begun at began) should end so that
// the job's preferred replica takes it: a singleton job this instance is
// not preferred for, led for at least RebalanceInterval (so that a
// preferred replica that does not take it cannot make it bounce). The age
// is read on the real clock, as the heartbeats that elect the preferred
// replica are paced; the schedule's clock has no say in it.
func (w *worker) handOver(began time.Time) bool {
	if w.j.shards > 0 {
		return false
	}
	mine, _ := w.r.pref.get(w.j.Name)
	return !mine && time.Since(began) >= w.r.cfg.RebalanceInterval
}

// runRequested runs the manual runs asked for that this term should start,
// oldest first; a failed look at the ledger is retried while the lease
// lasts.
func (w *worker) runRequested(ctx context.Context, t *term) {
	again := retry.Backoff{Base: w.r.lcfg.PollInterval, Max: 10 * w.r.lcfg.PollInterval}
	var failing retry.Failing
	for ctx.Err() == nil {
		rows, err := w.r.pool.Query(ctx, w.r.q.requested, w.j.Name, w.shard, int64(t.lease.Token()), w.j.Retry.MaxAttempts)
		var slots []time.Time
		if err == nil {
			slots, err = pgx.CollectRows(rows, pgx.RowTo[time.Time])
		}
		if err == nil {
			failing.Recover(w.log(), "pgfence runner: reading the manual runs recovered")
			for _, at := range slots {
				w.runSlot(ctx, t, slotRef{KindManual, at})
			}
			return
		}
		if ctx.Err() != nil {
			return
		}
		failing.Fail(w.log(), "pgfence runner: reading the manual runs asked for failing; retrying", err)
		wait.Sleep(ctx, again.Wait(failing.Count()-1))
	}
}

func firstErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// watchStuck marks the job stuck here (stuckJobs) when the term's lease is
// lost and its run has not returned a PollInterval later, and clears the
// mark once it does; the returned function is called when lead returns.
// A term that ends otherwise (a shutdown, a hand-over) is not watched: its
// replica is not holding the job back from the others.
func (w *worker) watchStuck(ctx context.Context) func() {
	var (
		mu     sync.Mutex
		timer  *time.Timer
		ended  bool
		marked bool
	)
	stop := context.AfterFunc(ctx, func() {
		if !errors.Is(context.Cause(ctx), lock.ErrLeaseLost) {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if ended {
			return
		}
		// Pacing the fleet's view: the real clock.
		timer = time.AfterFunc(w.r.lcfg.PollInterval, func() {
			mu.Lock()
			defer mu.Unlock()
			if !ended {
				marked = true
				w.log().Warn("pgfence runner: the run outlived its lease and has not returned; letting another replica take the job")
				w.r.stuck.set(w.j.Name, true)
			}
		})
	})
	return func() {
		stop()
		mu.Lock()
		defer mu.Unlock()
		ended = true
		if timer != nil {
			timer.Stop()
		}
		if marked {
			w.r.stuck.set(w.j.Name, false)
		}
	}
}

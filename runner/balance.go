package runner

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/retry"
)

type shardKey struct {
	job   *job
	shard int
}

// membersName is the pseudo-lease whose "release" announces a change of
// members: runners rebalance at once instead of at their next heartbeat.
const membersName = "pgfence/instances"

// deadInstanceRetention is how long the row of an instance that stopped
// heartbeating stays (for operators) before the living delete it.
const deadInstanceRetention = time.Hour

// members maps a sharded job's name to the ids of the live instances that
// registered it, sorted.
type members map[string][]string

// balance heartbeats this instance (with the jobs it registered), sets the
// singleton jobs' preferred leaders (prefer) and starts their workers, and
// keeps a worker for exactly the shards assigned to it: each job's shards
// are spread by assign over the live instances that registered that job, so
// services with different jobs can share a schema. Every instance computes
// the same assignment from the same rows; while views differ (an instance
// just joined or died) two instances may both want a shard, and the shard's
// lease decides.
//
// When it applies a new view: at once when members only left (their shards
// would otherwise stay unowned); when members joined (or at start-up, when
// it knows no view yet), only once the view has held still for a settle
// interval, or after RebalanceInterval of continuous change. Meanwhile the
// shards stay with their current owners. So replicas that start together,
// or one after another, move each shard about once instead of at every
// join.
//
// A join (announced after the first heartbeat) and a graceful leave
// (announced by Run's exit) make every runner of the schema heartbeat at
// once, so shards change hands in milliseconds rather than at the next
// RebalanceInterval.
//
// Heartbeats go over a connection of the balancer's own, so that they never
// wait behind jobs or waiting acquirers for a pooled connection.
func (r *Runner) balance(ctx context.Context, jobs, singles []*job) {
	changed, stopWatch := r.lc.Watch(membersName)
	defer stopWatch()
	own := ownconn.New(r.pool)
	defer own.Close()
	workers := make(map[shardKey]context.CancelFunc)
	g := bg.New(ctx) // the shard workers and the singleton jobs' workers
	defer g.Stop()
	var singleNames []string
	for _, j := range singles {
		singleNames = append(singleNames, j.Name)
	}
	// listed names the jobs this instance runs, for its heartbeat: every
	// sharded job and consumer group, and the singleton jobs not stuck here.
	listed := func() []string {
		names := []string{} // never NULL in the heartbeat
		for _, j := range jobs {
			names = append(names, j.member())
		}
		for _, j := range singleNames {
			if !r.stuck.is(j) {
				names = append(names, j)
			}
		}
		return names
	}
	var lastListed []string
	singlesStarted := false
	st := settler{settle: min(max(r.cfg.RebalanceInterval/4, 50*time.Millisecond), time.Second), patience: r.cfg.RebalanceInterval}
	announced, started := false, false
	var failing retry.Failing // one warning per failure period
	for {
		next := r.cfg.RebalanceInterval
		names := listed()
		view, soonest, err := r.heartbeat(ctx, own, names, !started)
		started = started || err == nil
		if err == nil && announced && !slices.Equal(names, lastListed) {
			// A singleton job stuck here, or back: the others look at
			// once, as for a join or a leave.
			announced = false
		}
		if err == nil {
			lastListed = names
		}
		if soonest > 0 {
			// Look again just after the first other member would expire.
			next = min(next, soonest+expiryLag)
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if permanent(err) {
				r.fatal(fmt.Errorf("runner: heartbeat: %w", err))
				return
			}
			r.m.heartbeatFailed()
			failing.Fail(r.log, "pgfence runner: heartbeats failing; keeping current shards", err)
		} else {
			failing.Recover(r.log, "pgfence runner: heartbeats recovered")
			now := time.Now()
			r.lastBeat.Store(&now)
			// Heartbeats pace database work, so they stay on the real clock.
			apply, settling := st.observe(view, time.Now())
			// A new view, or the applied one again once it holds still: the
			// assignment keeps what is held, and views and holders are read
			// by each instance at its own moment, so it is recomputed from
			// the holders at every heartbeat. That settles, within one, a
			// shard that two instances wanted or none did.
			counted, err := r.groupCounts(ctx, own, jobs)
			if err != nil && ctx.Err() == nil {
				r.log.Warn("pgfence runner: reading the consumer groups' partition counts failed; keeping the current ones", "err", err)
			}
			if len(jobs) > 0 && (apply || (!settling || counted) && st.applied != nil) {
				held, err := r.holders(ctx, own, jobs)
				switch {
				case err == nil:
					r.m.setLeaderless(jobs, held)
					r.apply(g, jobs, st.applied, held, workers)
				case apply && ctx.Err() == nil:
					// A new view must be applied (members that left own
					// shards): without the holders, by the plain hashing,
					// which moves more, still one owner per shard.
					r.log.Warn("pgfence runner: reading the shards' holders failed; assigning without them", "err", err)
					r.apply(g, jobs, st.applied, nil, workers)
				}
				// Otherwise the workers stay as they are until the next
				// heartbeat reads the holders.
			}
			if apply {
				r.prefer(singleNames, view)
				if !singlesStarted {
					// Singleton workers campaign once the view is known, so
					// that the replicas that start together give each job
					// to its preferred replica instead of to the first up.
					for _, j := range singles {
						w := &worker{r: r, j: j}
						g.Go(w.singleLoop)
					}
					singlesStarted = true
				}
			}
			if settling {
				// Look again once the view may have settled, or at a
				// member's expiry if that comes first.
				next = min(next, st.settle)
			}
		}
		if err == nil && !announced {
			actx, cancel := context.WithTimeout(ctx, r.balanceTimeout()) // as every statement here: a black-holed connection
			if _, err := own.Exec(actx, r.q.announce, membersName); err == nil {
				announced = true
			}
			cancel()
		}
		t := time.NewTimer(next)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		case <-changed:
			t.Stop()
		case <-r.stuck.nudge:
			t.Stop()
		case <-r.nudge:
			t.Stop()
		}
	}
}

// settler decides when the balancer applies a view of the members (see
// balance): at once when members only left; when members joined, once the
// view has held still for settle, or after patience of continuous change.
type settler struct {
	settle, patience time.Duration

	applied, pending       members // nil: none yet
	pendingSince, changing time.Time
}

// observe takes the view read at now and reports whether to apply it now,
// and whether it is settling (the next heartbeat should come after settle
// rather than after the regular interval).
func (s *settler) observe(view members, now time.Time) (apply, settling bool) {
	switch {
	case s.applied != nil && sameMembers(view, s.applied):
		s.pending = nil
		return false, false
	case s.applied != nil && onlyLeft(s.applied, view),
		s.pending != nil && sameMembers(view, s.pending) && now.Sub(s.pendingSince) >= s.settle,
		s.pending != nil && now.Sub(s.changing) >= s.patience:
		s.applied, s.pending = view, nil
		return true, false
	default: // joined, or not settled yet: wait for the view to hold still
		if s.pending == nil {
			s.changing = now
		}
		if s.pending == nil || !sameMembers(view, s.pending) {
			s.pending, s.pendingSince = view, now
		}
		return false, true
	}
}

// prefer records which of the singleton jobs this instance should lead
// under view.
func (r *Runner) prefer(singles []string, view members) {
	mine := map[string]bool{}
	for j, id := range spread(singles, view) {
		if id == r.lcfg.Holder {
			mine[j] = true
		}
	}
	r.pref.set(mine)
}

// sameMembers reports whether two views list the same members for every job.
func sameMembers(a, b members) bool { return maps.EqualFunc(a, b, slices.Equal[[]string]) }

// onlyLeft reports whether view differs from before only by members that
// left (view's members of every job are among before's).
func onlyLeft(before, view members) bool {
	for j, ids := range view {
		for _, id := range ids {
			if !slices.Contains(before[j], id) {
				return false
			}
		}
	}
	return true
}

// apply starts and stops shard workers to match the assignment in view.
func (r *Runner) apply(g *bg.Group, jobs []*job, view members, held map[string][]string, workers map[shardKey]context.CancelFunc) {
	for _, j := range jobs {
		ids := view[j.member()]
		me := slices.Index(ids, r.lcfg.Holder)
		owner := assign(j.Name, j.count(), ids, held[j.Name])
		owned := 0
		for _, o := range owner {
			if me >= 0 && o == me {
				owned++
			}
		}
		if j.group == nil { // a group's partitions have gauges of their own
			r.m.setShards(j.Name, int64(owned))
		}
		for s := range j.count() {
			k := shardKey{j, s}
			mine := me >= 0 && owner[s] == me
			stop, have := workers[k]
			switch {
			case mine && !have:
				sw := &worker{r: r, j: j, shard: s}
				run := sw.loop
				if j.group != nil {
					run = sw.groupLoop
				}
				if cancel, ok := g.Start(run); ok {
					workers[k] = cancel
				}
			case !mine && have:
				stop() // the group still waits for it
				delete(workers, k)
			}
		}
		// A consumer group whose count went down: the partitions dropped.
		for k, stop := range workers {
			if k.job == j && k.shard >= j.count() {
				stop()
				delete(workers, k)
			}
		}
	}
}

// groupCounts reads the partition counts of the consumer groups among
// jobs (they change with SetPartitions), ends the changes under way whose
// partitions have all reached the cut, and reports whether a count
// changed (the assignment is then applied at once).
func (r *Runner) groupCounts(ctx context.Context, own *ownconn.Conn, jobs []*job) (changed bool, err error) {
	var names []string
	byName := map[string]*job{}
	for _, j := range jobs {
		if j.group != nil {
			names = append(names, j.Name)
			byName[j.Name] = j
		}
	}
	if len(names) == 0 {
		return false, nil
	}
	qctx, cancel := context.WithTimeout(ctx, r.balanceTimeout())
	defer cancel()
	rows, err := own.Query(qctx, r.q.groupCounts, names)
	if err != nil {
		return false, err
	}
	var changing []string
	for rows.Next() {
		var (
			name        string
			count, next int
		)
		if err := rows.Scan(&name, &count, &next); err != nil {
			rows.Close()
			return false, err
		}
		if j := byName[name]; j != nil && j.parts.Swap(int64(count)) != int64(count) {
			changed = true
		}
		if next != 0 {
			changing = append(changing, name)
		}
	}
	if err := rows.Err(); err != nil {
		return false, err
	}
	for _, g := range changing {
		switch switched, err := r.finishChange(ctx, g); {
		case err != nil && ctx.Err() == nil:
			// Busy partitions (a lease row held past the bound), or the
			// database: tried again at the next heartbeat.
			r.log.Info("pgfence runner: a change of a consumer group's partition count could not end yet; trying again",
				"group", g, "err", err)
		case switched:
			r.nudgeBalancer() // read the new count and apply it at once
		}
	}
	return changed, nil
}

// expiryLag is how long after another member's expected expiry the
// balancer looks again: past it by the database's clock, with room for the
// round trip.
const expiryLag = 50 * time.Millisecond

// balanceTimeout bounds one of the balancer's statements, with the dial of
// its connection when that broke: the TTL, after which the liveness row the
// heartbeat renews has expired anyway, so that a connection to a server
// that stopped answering is given up and dialled again. Not the
// RebalanceInterval: a loaded server or machine can take longer than that
// for a dial and a statement, and cutting it closes the connection, so each
// heartbeat would dial again and fail again.
func (r *Runner) balanceTimeout() time.Duration { return r.lcfg.TTL }

// heartbeat renews this instance's liveness row, listing the jobs it runs,
// pokes the workers of its jobs that have manual runs pending (their
// notification may not have arrived), and returns the live members of
// every job. first says no heartbeat of this Run has succeeded yet: it
// records the instance's start, so that a restart with the same Holder
// shows its own start time.
//
// soonest is how long until the first of the other live members expires
// unless it heartbeats again (0: none is live): the balancer looks again
// then, so that a crashed member's jobs move within its TTL, not a
// RebalanceInterval later.
func (r *Runner) heartbeat(ctx context.Context, own *ownconn.Conn, jobs []string, first bool) (view members, soonest time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, r.balanceTimeout())
	defer cancel()
	rows, err := own.Query(ctx, r.q.heartbeat, r.lcfg.Holder, r.lcfg.TTL.Microseconds(), jobs,
		deadInstanceRetention.Microseconds(), first)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	view = members{}
	for rows.Next() {
		var (
			id            string
			runs, pending []string
			shards        []int
			expiresIn     *int64 // microseconds; nil for this instance's row
		)
		if err := rows.Scan(&id, &runs, &pending, &shards, &expiresIn); err != nil {
			return nil, 0, err
		}
		for _, j := range runs {
			view[j] = append(view[j], id)
		}
		for i, j := range pending {
			r.poke(j, shards[i])
		}
		if expiresIn != nil {
			if d := time.Duration(*expiresIn) * time.Microsecond; soonest == 0 || d < soonest {
				soonest = max(d, time.Microsecond)
			}
		}
	}
	for _, ids := range view {
		slices.Sort(ids)
	}
	return view, soonest, rows.Err()
}

// holders reads who holds each shard (and partition) of jobs now: job name
// -> holder id per shard, "" where none holds it. Read at every heartbeat
// once the view holds still, so that the assignment keeps what is held
// (assign).
func (r *Runner) holders(ctx context.Context, own *ownconn.Conn, jobs []*job) (map[string][]string, error) {
	ctx, cancel := context.WithTimeout(ctx, r.balanceTimeout())
	defer cancel()
	var names []string
	at := make(map[string]shardKey)
	held := make(map[string][]string, len(jobs))
	for _, j := range jobs {
		held[j.Name] = make([]string, j.count())
		for s := range j.count() {
			name := (&worker{j: j, shard: s}).leaseName()
			names = append(names, name)
			at[name] = shardKey{j, s}
		}
	}
	if len(names) == 0 {
		return held, nil
	}
	rows, err := own.Query(ctx, r.q.holders, names)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var name, holder string
		if err := rows.Scan(&name, &holder); err != nil {
			return nil, err
		}
		if k, ok := at[name]; ok {
			held[k.job.Name][k.shard] = holder
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	return held, nil
}

package runner

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/pgfence/pgfence/internal/wait"
)

type shardKey struct {
	job   *job
	shard int
}

type shardWorker struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// deadInstanceRetention is how long the row of an instance that stopped
// heartbeating stays (for operators) before the living delete it.
const deadInstanceRetention = time.Hour

// members maps a sharded job's name to the ids of the live instances that
// registered it, sorted.
type members map[string][]string

// balance heartbeats this instance (with the sharded jobs it registered) and
// keeps a worker for exactly the shards assigned to it: each job's shards
// are spread by assign over the live instances that registered that job, so
// services with different jobs can share a schema. Every instance computes
// the same assignment from the same rows; while views differ (an instance
// just joined or died) two instances may both want a shard, and the shard's
// lease decides.
//
// An instance starts no shard worker until its view of the members has
// held still for one settle interval: replicas that start together would
// otherwise each see only themselves at first, take every shard, and hand
// most of them over again at the next heartbeat.
func (r *Runner) balance(ctx context.Context, jobs []*job) {
	workers := make(map[shardKey]*shardWorker)
	var wg sync.WaitGroup
	defer func() {
		for _, w := range workers {
			w.cancel()
		}
		wg.Wait()
	}()
	names := make([]string, len(jobs))
	for i, j := range jobs {
		names[i] = j.Name
	}
	settle := min(max(r.cfg.RebalanceInterval/4, 50*time.Millisecond), time.Second)
	var (
		seen    members // the view at the previous heartbeat, until settled
		settled bool
		waited  time.Duration
	)
	for {
		next := r.cfg.RebalanceInterval
		view, err := r.heartbeat(ctx, names)
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			if permanent(err) {
				r.fatal(fmt.Errorf("runner: heartbeat: %w", err))
				return
			}
			r.log.Warn("pgfence runner: heartbeat failed; keeping current shards", "err", err)
		case !settled && (seen == nil || !maps.EqualFunc(seen, view, slices.Equal[[]string])) && waited < r.cfg.RebalanceInterval:
			seen, next = view, settle
			waited += settle
		default:
			settled = true
			r.apply(ctx, jobs, view, workers, &wg)
		}
		if !wait.Sleep(ctx, next) {
			return
		}
	}
}

// apply starts and stops shard workers to match the assignment in view.
func (r *Runner) apply(ctx context.Context, jobs []*job, view members, workers map[shardKey]*shardWorker, wg *sync.WaitGroup) {
	for _, j := range jobs {
		ids := view[j.Name]
		me := slices.Index(ids, r.cfg.Lock.Holder)
		owner := assign(j.Name, j.shards, ids)
		for s := range j.shards {
			k := shardKey{j, s}
			mine := me >= 0 && owner[s] == me
			w, have := workers[k]
			switch {
			case mine && !have:
				wctx, cancel := context.WithCancel(ctx)
				w = &shardWorker{cancel: cancel, done: make(chan struct{})}
				workers[k] = w
				sw := &worker{r: r, j: j, shard: s}
				wg.Add(1)
				go func() { defer wg.Done(); defer close(w.done); sw.loop(wctx) }()
			case !mine && have:
				w.cancel()
				delete(workers, k)
				wg.Add(1)
				go func() { defer wg.Done(); <-w.done }()
			}
		}
	}
}

// heartbeat renews this instance's liveness row, listing the sharded jobs it
// runs, and returns the live members of every job.
func (r *Runner) heartbeat(ctx context.Context, jobs []string) (members, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.RebalanceInterval)
	defer cancel()
	rows, err := r.pool.Query(ctx, r.q.heartbeat, r.cfg.Lock.Holder, r.cfg.Lock.TTL.Microseconds(), jobs,
		deadInstanceRetention.Microseconds())
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	view := members{}
	for rows.Next() {
		var (
			id   string
			runs []string
		)
		if err := rows.Scan(&id, &runs); err != nil {
			return nil, err
		}
		for _, j := range runs {
			view[j] = append(view[j], id)
		}
	}
	for _, ids := range view {
		slices.Sort(ids)
	}
	return view, rows.Err()
}

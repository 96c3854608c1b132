package runner

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"
)

type shardKey struct {
	job   *job
	shard int
}

type shardWorker struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// balance heartbeats this instance and keeps a worker for exactly the shards
// assigned to it: with the live instances sorted by id, shard s of every
// sharded job belongs to instances[s mod len(instances)]. Every instance
// computes the same assignment from the same rows; while views differ (an
// instance just joined or died) two instances may both want a shard, and the
// shard's lease decides.
func (r *Runner) balance(ctx context.Context, jobs []*job) {
	workers := make(map[shardKey]*shardWorker)
	var wg sync.WaitGroup
	defer func() {
		for _, w := range workers {
			w.cancel()
		}
		wg.Wait()
	}()
	t := time.NewTicker(r.cfg.RebalanceInterval)
	defer t.Stop()
	for {
		if live, err := r.heartbeat(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			if permanent(err) {
				r.fatal(fmt.Errorf("runner: heartbeat: %w", err))
				return
			}
			r.cfg.Logger.Warn("pgfence runner: heartbeat failed; keeping current shards", "err", err)
		} else {
			me := slices.Index(live, r.cfg.Instance)
			for _, j := range jobs {
				for s := range j.shards {
					k := shardKey{j, s}
					mine := me >= 0 && s%len(live) == me
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
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// heartbeat renews this instance's liveness row and returns the live
// instances' ids, sorted.
func (r *Runner) heartbeat(ctx context.Context) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.RebalanceInterval)
	defer cancel()
	rows, err := r.pool.Query(ctx, r.q.heartbeat, r.cfg.Instance, r.cfg.TTL.Microseconds())
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ids = append(ids, id)
	}
	return ids, rows.Err()
}

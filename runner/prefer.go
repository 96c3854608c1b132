package runner

import (
	"sync"
	"time"
)

// Spreading singleton jobs: every replica campaigns for every singleton job
// (so a crashed leader's job is taken over within its TTL and a poll), but
// only the job's preferred replica (spread, over the balancer's view) takes
// a freed lease at once; the others defer (lock.Defer) for deferFor. A
// leader that is not preferred hands the job over between runs (ends its
// term, releasing the lease: the preferred replica, woken by the release,
// takes it), at most once per RebalanceInterval of term, so that a
// preferred replica that does not take it cannot make the job bounce.

// preference says which singleton jobs this instance should lead.
type preference struct {
	mu      sync.Mutex
	known   bool            // a view has been applied
	mine    map[string]bool // by job name
	changed chan struct{}   // closed, and replaced, at each change
}

func newPreference() *preference { return &preference{changed: make(chan struct{})} }

// set records the jobs this instance should lead and wakes those who wait
// for a change.
func (p *preference) set(mine map[string]bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.known, p.mine = true, mine
	close(p.changed)
	p.changed = make(chan struct{})
}

// get says whether this instance should lead job (true until a view is
// known: a replica alone leads at once), and returns a channel closed at
// the next change.
func (p *preference) get(job string) (mine bool, changed <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.known || p.mine[job], p.changed
}

// deferFor is how long a replica that is not a singleton job's preferred
// leader leaves a freed lease of the job to the preferred one: half a
// PollInterval, so a takeover after a crash still comes within the TTL and
// one PollInterval.
func (r *Runner) deferFor() time.Duration { return r.lcfg.PollInterval / 2 }

// pokes lets the balancer wake the worker leading a job's shard when a
// heartbeat finds manual runs pending for it, in case their notification
// never arrived (a connection behind PgBouncer cannot LISTEN).
type pokes struct {
	mu sync.Mutex
	by map[string]chan struct{} // wakeName -> the leading worker's channel
}

// add registers the worker now leading key; the function removes it.
func (p *pokes) add(key string) (<-chan struct{}, func()) {
	c := make(chan struct{}, 1)
	p.mu.Lock()
	if p.by == nil {
		p.by = map[string]chan struct{}{}
	}
	p.by[key] = c
	p.mu.Unlock()
	return c, func() {
		p.mu.Lock()
		if p.by[key] == c {
			delete(p.by, key)
		}
		p.mu.Unlock()
	}
}

// poke wakes the worker leading job's shard here, if any.
func (r *Runner) poke(job string, shard int) {
	r.mu.Lock()
	shards := -1
	for _, j := range r.jobs {
		if j.Name == job {
			shards = j.shards
		}
	}
	r.mu.Unlock()
	if shards < 0 {
		return // another service's job
	}
	r.pokes.mu.Lock()
	c := r.pokes.by[wakeName(job, shards, shard)]
	r.pokes.mu.Unlock()
	if c != nil {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

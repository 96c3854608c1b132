package runner

import "sync"

// Spreading singleton jobs: only the job's preferred replica (spread, over
// the balancer's view) campaigns for it (worker.singleLoop). A leader that
// is not preferred hands the job over between runs (ends its term,
// releasing the lease: the preferred replica, woken by the release, takes
// it), at most once per RebalanceInterval of term, so that a preferred
// replica that does not take it cannot make the job bounce.

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

// stuckJobs are the singleton jobs whose term lost its lease while its run
// did not return (a job that ignores its context): this instance stops
// listing them in its heartbeat until the run returns, so that the other
// replicas see it gone from the job and the next preferred one takes the
// job over. The balancer is nudged at each change.
type stuckJobs struct {
	mu    sync.Mutex
	jobs  map[string]bool
	nudge chan struct{} // buffered 1: the balancer heartbeats at once
}

func newStuckJobs() stuckJobs {
	return stuckJobs{jobs: map[string]bool{}, nudge: make(chan struct{}, 1)}
}

// set marks job stuck or not, and nudges the balancer on a change.
func (s *stuckJobs) set(job string, stuck bool) {
	s.mu.Lock()
	changed := s.jobs[job] != stuck
	if stuck {
		s.jobs[job] = true
	} else {
		delete(s.jobs, job)
	}
	s.mu.Unlock()
	if changed {
		select {
		case s.nudge <- struct{}{}:
		default:
		}
	}
}

// is reports whether job is stuck here.
func (s *stuckJobs) is(job string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.jobs[job]
}

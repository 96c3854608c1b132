package runner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/schemaver"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
)

// Runner runs registered jobs so that each slot of each job (and shard) runs
// on exactly one of the replicas that run the same Runner, fenced by the
// job's lease token. Register jobs, then call Run on every replica.
type Runner struct {
	pool *pgxpool.Pool
	cfg  Config
	lcfg lock.Config // the client's, defaults filled in
	q    *queries
	lc   *lock.Client
	log  *slog.Logger
	m    *metrics
	// clock is what the schedule's slots are computed and waited for on
	// (the real clock; tests move a fake one).
	clock clock.Clock
	pref  *preference   // which singleton jobs this instance should lead
	stuck stuckJobs     // singleton jobs whose run outlived its lease here
	pokes pokes         // the leading workers, woken when manual runs are pending
	nudge chan struct{} // buffered 1: the balancer heartbeats at once (a partition reached a change's cut)

	heldMu sync.Mutex
	held   map[*lock.Lease]*worker // the leases of running terms, with their workers

	mu      sync.Mutex
	jobs    []*job
	names   map[string]bool
	running bool

	live     atomic.Bool               // Run has started the jobs and not returned
	lastBeat atomic.Pointer[time.Time] // when the last heartbeat succeeded (real clock, monotonic); nil: no jobs, no heartbeats

	fatal func(error) // set by Run: stop everything with this error
}

type job struct {
	Job
	sched  Schedule
	shards int       // 0: singleton; a consumer group's partitions as registered
	group  *Consumer // a consumer group's member, not a scheduled job
	// parts is a consumer group's partition count now (SetPartitions
	// changes it): written by the balancer, which reads it with count.
	parts atomic.Int64
}

// count is the job's shard count, or the group's partition count now.
func (j *job) count() int {
	if j.group != nil {
		return int(j.parts.Load())
	}
	return j.shards
}

// member is the name the job is listed under in pgfence_instances, by
// which its members are found: a group's is prefixed, so that a group and a
// job of the same name in two services sharing a schema are not taken for
// one.
func (j *job) member() string {
	if j.group != nil {
		return groupLeasePrefix + j.Name
	}
	return j.Name
}

// nudgeBalancer makes the balancer heartbeat at once.
func (r *Runner) nudgeBalancer() {
	select {
	case r.nudge <- struct{}{}:
	default:
	}
}

// ErrNilClient is returned by New for a nil client.
var ErrNilClient = errors.New("runner: nil lock client")

// New returns a runner that leads its jobs with client's leases: the
// client's schema holds the ledger, its Holder is this runner's instance id
// (unique among live runners), its TTL is also the TTL of the instance's
// liveness row, its PollInterval is how often a replica waiting to take
// over a job it should lead checks the lease when no release notification
// arrives, and its Logger and MeterProvider receive the runner's logs and
// metrics. One client serves the runner and the application's own leases,
// with one renewer, one listener and one poller. The runner does not close
// the client; close it after Run has returned.
//
// New validates cfg (see Config for the defaults) and returns a
// *ConfigError naming the bad field (it matches ErrInvalidConfig). It does
// not touch the database: Run checks the schema.
func New(client *lock.Client, cfg Config) (*Runner, error) {
	if client == nil {
		return nil, ErrNilClient
	}
	if err := cfg.checkSigns(); err != nil {
		return nil, err
	}
	lcfg := client.Config()
	cfg = cfg.withDefaults(lcfg)
	if err := cfg.validate(lcfg); err != nil {
		return nil, err
	}
	m, err := newMetrics(lcfg.MeterProvider)
	if err != nil {
		return nil, err
	}
	return &Runner{pool: client.Pool(), cfg: cfg, lcfg: lcfg, q: sqlFor(lcfg.Schema), lc: client, log: lcfg.Logger.With("holder", lcfg.Holder), m: m, clock: clock.Real(), pref: newPreference(), stuck: newStuckJobs(),
		names: make(map[string]bool), held: make(map[*lock.Lease]*worker), nudge: make(chan struct{}, 1)}, nil
}

// Observe reports who leads the job name (and shard; 0 for an unsharded job) to a
// replica that may not lead it: the channel receives the job's lease state
// now and at each change of leader, within milliseconds, until ctx ends
// (see lock.Client.Observe). Info.Holder is the leading instance, "" (or
// Held false) when none leads. It returns ErrUnknownJob for a job not
// registered on this runner, ErrNoSuchShard for a shard it does not have.
func (r *Runner) Observe(ctx context.Context, name string, shard int) (<-chan lock.Info, error) {
	if err := ctxcheck.NotNil(ctx, "runner: Runner.Observe"); err != nil {
		return nil, err
	}
	r.mu.Lock()
	var found *job
	for _, j := range r.jobs {
		if j.Name == name {
			found = j
		}
	}
	r.mu.Unlock()
	switch {
	case found == nil:
		return nil, fmt.Errorf("runner: observe job %q: %w", name, ErrUnknownJob)
	case shard < 0 || shard >= max(found.shards, 1):
		return nil, fmt.Errorf("%w: job %q has %s", ErrNoSuchShard, name, shardCount(found.shards))
	}
	return r.lc.Observe(ctx, (&worker{j: found, shard: shard}).leaseName())
}

// Instance returns this runner's instance identity (its client's Holder).
func (r *Runner) Instance() string { return r.lcfg.Holder }

// Register adds a singleton job: each slot runs on exactly one replica, the
// one that holds the job's lease. Singleton jobs spread over the replicas
// that registered them (each leads at most 1.25 times its share, rounded
// up): only a job's preferred replica campaigns for it, and a leader that
// is no longer preferred hands the job over between runs. A crashed
// leader's job is taken over by its next preferred replica within about a
// TTL (once the crashed instance's liveness row and the job's lease have
// expired). It returns a *JobError naming the field at fault
// (it matches ErrInvalidJob, and ErrInvalidSchedule for the schedule),
// ErrDuplicateJob, or ErrRunning.
func (r *Runner) Register(j Job) error { return r.register(j, 0) }

// RegisterSharded adds a job with shards shards: each shard has its own lease
// and fencing token, shards are spread evenly over the live runner instances
// (rebalanced as instances come and go), and every shard runs every slot.
// shards must be at least 1.
func (r *Runner) RegisterSharded(j Job, shards int) error {
	if shards < 1 || shards > 1<<16 {
		return &JobError{Job: j.Name, Field: "shards", Reason: fmt.Sprintf("must be between 1 and 65536, got %d", shards)}
	}
	return r.register(j, shards)
}

func (r *Runner) register(j Job, shards int) error {
	sched, err := j.validate()
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running {
		return ErrRunning
	}
	if r.names[j.Name] {
		return fmt.Errorf("%w: %q", ErrDuplicateJob, j.Name)
	}
	r.names[j.Name] = true
	r.jobs = append(r.jobs, &job{Job: j, sched: sched, shards: shards})
	return nil
}

var errShutdown = errors.New("runner: shutting down")

// ErrNotStopped is matched by a *StopError: Run returned although jobs
// still run.
var ErrNotStopped = errors.New("runner: jobs did not stop")

// ErrTermsNotEnded is matched by Run's error when every job's function
// returned within ShutdownTimeout of its context's end but ending their
// terms (recording their runs and ends, releasing their leases, on a
// database slow or cut off) did not: it goes on in the background, and
// their leases are released at once, as for a *StopError.
var ErrTermsNotEnded = errors.New("runner: the jobs stopped, but their terms did not end within ShutdownTimeout")

// StopError is Run's error when jobs did not return within
// ShutdownTimeout of its context's end. Their leases were released (so
// their later guarded writes are refused and another replica takes over),
// but their goroutines still run: a function that ignores its context
// cannot be stopped from outside. It matches ErrNotStopped.
type StopError struct {
	// Jobs names the jobs (job/shard for a shard) whose function still
	// runs: Job.Run, a group's Consume or End, or an OnEvent of theirs.
	Jobs []string
	// Timeout is the ShutdownTimeout they did not return within.
	Timeout time.Duration
}

// Error names the jobs.
func (e *StopError) Error() string {
	return fmt.Sprintf("runner: jobs did not stop within ShutdownTimeout (%v): %s; their leases are released at once "+
		"(one whose release fails expires by its TTL)", e.Timeout, strings.Join(e.Jobs, ", "))
}

// Is makes errors.Is(err, ErrNotStopped) true.
func (e *StopError) Is(target error) bool { return target == ErrNotStopped }

// Run runs the registered jobs until ctx ends. Then it stops gracefully:
// running jobs have their contexts cancelled and get ShutdownTimeout to
// return, and every lease is released so another replica takes over at once.
// A run that does not return in time is abandoned: its lease is released
// anyway, so its later guarded writes are refused, and Run returns a
// *StopError naming it (its goroutine is still running then). When every
// job has returned but ending their terms (recording runs and ends,
// releasing leases) outlasts ShutdownTimeout, on a database slow or cut
// off, their leases are released the same way and Run returns an error
// matching ErrTermsNotEnded, which names no job. Run returns nil after a
// clean stop, only.
//
// Run first checks that the schema is migrated (a
// *migrations.NotMigratedError if not) and registers the jobs and consumer
// groups (a *PartitionCountError for a group whose partition count differs from the
// registered one: nothing starts); if ctx ends before that completes, Run
// returns nil. A permanent database error later
// (a dropped table, revoked privileges: see package lock for the
// classification) stops every job the same graceful way and is returned;
// transient errors are retried.
func (r *Runner) Run(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "runner: Runner.Run"); err != nil {
		return err
	}
	r.mu.Lock()
	if r.running {
		r.mu.Unlock()
		return ErrRunning
	}
	r.running = true
	jobs := append([]*job(nil), r.jobs...)
	r.mu.Unlock()

	if err := r.verify(ctx, jobs); err != nil {
		if ctx.Err() != nil {
			return nil // stopped while starting: a clean stop, as Election.Run's
		}
		return err
	}
	if len(jobs) > 0 {
		now := time.Now() // the first heartbeat is due within a TTL
		r.lastBeat.Store(&now)
	}
	r.live.Store(true)
	defer r.live.Store(false)
	var names []string // the jobs, for the job gauges; groups have gauges of their own
	groups := make(map[string]int)
	for _, j := range jobs {
		if j.group != nil {
			groups[j.Name] = j.shards
		} else {
			names = append(names, j.Name)
		}
	}
	if reg, err := r.m.observe(names, groups); err == nil {
		defer func() { _ = reg.Unregister() }()
	}
	work, stopWork := context.WithCancelCause(context.Background())
	var (
		fatalMu  sync.Mutex // a job that did not stop within ShutdownTimeout may still call fatal
		fatalErr error
	)
	r.fatal = func(err error) {
		fatalMu.Lock()
		defer fatalMu.Unlock()
		if fatalErr != nil {
			return
		}
		fatalErr = err
		r.log.Error("pgfence runner: stopping on a permanent error", "err", err)
		stopWork(err)
	}
	// The workers, the balancer and the pruner: one group, stopped by
	// cancelling work (with the cause errShutdown), then waited for.
	g := bg.New(work)
	var sharded, singles []*job
	for _, j := range jobs {
		if j.shards > 0 {
			sharded = append(sharded, j)
		} else {
			singles = append(singles, j)
		}
	}
	if len(jobs) > 0 {
		g.Go(func(ctx context.Context) { r.balance(ctx, sharded, singles) })
	}
	g.Go(r.prune)

	select {
	case <-ctx.Done():
	case <-work.Done():
	}
	stopWork(errShutdown)
	// g.Stop on a goroutine of its own, so that ShutdownTimeout can bound
	// the wait.
	stopped := bg.Run(context.Background(), func(context.Context) { g.Stop() }).StopWithin(r.cfg.ShutdownTimeout)
	var err error
	// What follows the wait has wait.CleanupTimeout in all, whatever the
	// network does: releasing the leases of jobs that did not stop, and
	// recording the leave.
	cctx, cancel := wait.Detached(context.Background())
	defer cancel()
	if !stopped {
		// A job's function that has returned is not named: its term may
		// still be ending (recording its run and its end, releasing its
		// lease) on a database slow or cut off.
		if running := r.runningJobs(); len(running) > 0 {
			stuck := &StopError{Jobs: running, Timeout: r.cfg.ShutdownTimeout}
			r.log.Warn("pgfence runner: jobs did not stop within ShutdownTimeout; releasing their leases anyway", "jobs", stuck.Jobs)
			err = stuck
		} else {
			r.log.Warn("pgfence runner: the jobs stopped, but ending their terms outlasted ShutdownTimeout (the database " +
				"is slow or cut off); releasing their leases now")
			err = fmt.Errorf("%w (%v): it goes on in the background, and their leases are released at once "+
				"(one whose release fails expires by its TTL)", ErrTermsNotEnded, r.cfg.ShutdownTimeout)
		}
		err = errors.Join(err, r.releaseHeld(cctx))
	}
	if _, lerr := r.pool.Exec(cctx, r.q.leave, r.lcfg.Holder, membersName); lerr != nil {
		// The others see this instance gone when its heartbeat row expires.
		r.log.Warn("pgfence runner: could not record leaving; the other instances will see it gone when its row expires", "err", lerr)
	}
	fatalMu.Lock()
	defer fatalMu.Unlock()
	if fatalErr != nil {
		return fatalErr
	}
	return err
}

// hold records the lease of a term that starts, and returns the function
// that forgets it when the term ends.
func (r *Runner) hold(w *worker, l *lock.Lease) func() {
	r.heldMu.Lock()
	r.held[l] = w
	r.heldMu.Unlock()
	return func() {
		r.heldMu.Lock()
		delete(r.held, l)
		r.heldMu.Unlock()
	}
}

// runningJobs names the jobs (job/shard) whose terms still run one of
// their functions, sorted.
func (r *Runner) runningJobs() []string {
	r.heldMu.Lock()
	defer r.heldMu.Unlock()
	names := make([]string, 0, len(r.held))
	for l, w := range r.held {
		if w.calls.Load() > 0 {
			names = append(names, strings.TrimPrefix(strings.TrimPrefix(l.Name(), jobLeasePrefix), groupLeasePrefix))
		}
	}
	slices.Sort(names)
	return names
}

// releaseHeld releases the leases of the terms still running after
// ShutdownTimeout, so that another replica takes their jobs over at once
// and the late writes of the jobs that did not stop are refused.
func (r *Runner) releaseHeld(ctx context.Context) error {
	r.heldMu.Lock()
	held := maps.Clone(r.held)
	r.heldMu.Unlock()
	// At once, so that they share ctx's budget instead of each taking it
	// in turn. Each term is recorded as ended by the shutdown first, so
	// that the next leader does not take it for expired.
	errs := make([]error, 0, len(held))
	var (
		mu sync.Mutex
		wg sync.WaitGroup
	)
	for l, w := range held {
		wg.Go(func() {
			w.endTerm(ctx, l, EndShutdown)
			err := l.Release(ctx)
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// verify checks the schema and registers the jobs in pgfence_jobs (for
// operators: status, pause, run now), retrying transient errors until ctx
// ends.
func (r *Runner) verify(ctx context.Context, jobs []*job) error {
	var (
		names, schedules []string
		shards, attempts []int
		groups           []string
		partitions       []int
	)
	for _, j := range jobs {
		if j.group != nil {
			// A group has no schedule nor ledger (pgfence_offsets); its
			// partition count is registered apart.
			groups, partitions = append(groups, j.Name), append(partitions, j.shards)
			continue
		}
		names, schedules = append(names, j.Name), append(schedules, j.Schedule)
		shards, attempts = append(shards, j.shards), append(attempts, j.Retry.MaxAttempts)
	}
	b := retry.Backoff{Base: r.lcfg.PollInterval, Max: 10 * r.lcfg.PollInterval}
	var failing retry.Failing
	for {
		err := schemaver.Verify(ctx, r.pool, r.lcfg.Schema)
		// The groups first: a runner refused for a group's count
		// registers nothing.
		if err == nil && len(groups) > 0 {
			var mismatch error
			registered := map[string]int{}
			mismatch, err = r.registerGroups(ctx, groups, partitions, registered)
			for _, j := range jobs {
				if n, ok := registered[j.Name]; ok && j.group != nil {
					j.parts.Store(int64(n)) // the schema's count, which may not be the one given
				}
			}
			if mismatch != nil {
				r.log.Error("pgfence runner: not starting: a consumer group's partition count differs from the registered one",
					"err", mismatch)
				return mismatch
			}
		}
		if err == nil {
			if _, err = r.pool.Exec(ctx, r.q.register, names, schedules, shards, attempts, r.lcfg.Holder); err != nil {
				err = fmt.Errorf("register the jobs: %w", hint.Wrap(err, r.lcfg.Schema, hint.Role(r.pool)))
			}
		}
		if err == nil || !retry.Transient(err) {
			if err != nil {
				return fmt.Errorf("runner: %w", err)
			}
			failing.Recover(r.log, "pgfence runner: schema checked")
			return nil
		}
		failing.Fail(r.log, "pgfence runner: cannot check the schema yet; retrying", err)
		if !wait.Sleep(ctx, b.Wait(failing.Count()-1)) {
			return ctx.Err()
		}
	}
}

// registerGroups registers the groups' partition counts and returns a
// *PartitionCountError for the first group whose registered count is not
// the one given (as mismatch), or the statement's error.
func (r *Runner) registerGroups(ctx context.Context, groups []string, partitions []int, registered map[string]int) (mismatch, err error) {
	rows, err := r.pool.Query(ctx, r.q.registerGroups, groups, partitions, r.lcfg.Holder)
	if err != nil {
		return nil, fmt.Errorf("register the consumer groups: %w", hint.Wrap(err, r.lcfg.Schema, hint.Role(r.pool)))
	}
	given := make(map[string]int, len(groups))
	for i, ro := range groups {
		given[ro] = partitions[i]
	}
	var bad []*PartitionCountError
	for rows.Next() {
		e := &PartitionCountError{}
		var next int
		if err := rows.Scan(&e.Group, &e.Registered, &next, &e.RegisteredAt, &e.RegisteredBy); err != nil {
			rows.Close()
			return nil, fmt.Errorf("register the consumer groups: %w", err)
		}
		// During a change of the count, the count it changes to is
		// accepted too: the replicas of a rolling deploy that changes it.
		if e.Given = given[e.Group]; e.Given != e.Registered && e.Given != next {
			bad = append(bad, e)
		}
		registered[e.Group] = e.Registered
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("register the consumer groups: %w", hint.Wrap(err, r.lcfg.Schema, hint.Role(r.pool)))
	}
	if len(bad) > 0 {
		return bad[0], nil
	}
	return nil, nil
}

// permanent reports a database error that retrying will not fix.
func permanent(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && !retry.Transient(err) && !errors.Is(err, fence.ErrFenced)
}

func (r *Runner) emit(e Event) {
	if r.cfg.OnEvent != nil {
		r.cfg.OnEvent(e)
	}
}

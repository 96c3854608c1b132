package runner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// Runner runs registered jobs so that each slot of each job (and shard) runs
// on exactly one of the replicas that run the same Runner, fenced by the
// job's lease token. Register jobs, then call Run on every replica.
type Runner struct {
	pool *pgxpool.Pool
	cfg  Config
	q    queries
	lc   *lock.Client
	log  *slog.Logger
	m    *metrics

	mu      sync.Mutex
	jobs    []*job
	names   map[string]bool
	running bool

	fatal func(error) // set by Run: stop everything with this error
}

type job struct {
	Job
	sched  Schedule
	shards int // 0: singleton
}

// ErrNilPool is returned by New for a nil pool.
var ErrNilPool = errors.New("runner: nil pool")

// New returns a runner on pool's database. It validates cfg (see Config for
// the defaults) and returns a *ConfigError naming the bad field (it matches
// ErrInvalidConfig). It does not touch the database: Run checks the schema.
func New(pool *pgxpool.Pool, cfg Config) (*Runner, error) {
	if pool == nil {
		return nil, ErrNilPool
	}
	if err := cfg.checkSigns(); err != nil {
		return nil, err
	}
	lc, err := lock.New(pool, cfg.Lock)
	if err != nil {
		return nil, fromLock(err)
	}
	cfg = cfg.withDefaults(lc.Config())
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Lock.MeterProvider)
	if err != nil {
		return nil, err
	}
	return &Runner{pool: pool, cfg: cfg, q: newQueries(cfg.Lock.Schema), lc: lc, log: cfg.Lock.Logger, m: m,
		names: make(map[string]bool)}, nil
}

// Instance returns this runner's instance identity (Config.Lock.Holder).
func (r *Runner) Instance() string { return r.cfg.Lock.Holder }

// Register adds a singleton job: each slot runs on exactly one replica, the
// one that holds the job's lease (whichever took it first; it keeps it until
// it stops or loses it, so one replica may lead many singleton jobs). To
// spread many jobs over the replicas, register each with RegisterSharded(j,
// 1) instead, at the price of a slower takeover after a crash (the TTL plus
// up to one RebalanceInterval). It returns ErrInvalidJob /
// ErrInvalidSchedule (naming the problem), ErrDuplicateJob, or ErrRunning.
func (r *Runner) Register(j Job) error { return r.register(j, 0) }

// RegisterSharded adds a job with shards shards: each shard has its own lease
// and fencing token, shards are spread evenly over the live runner instances
// (rebalanced as instances come and go), and every shard runs every slot.
// shards must be at least 1.
func (r *Runner) RegisterSharded(j Job, shards int) error {
	if shards < 1 || shards > 1<<16 {
		return fmt.Errorf("%w: job %q: shards must be between 1 and 65536, got %d", ErrInvalidJob, j.Name, shards)
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

// Run runs the registered jobs until ctx ends. Then it stops gracefully:
// running jobs have their contexts cancelled and get ShutdownTimeout to
// return, and every lease is released so another replica takes over at once.
// A run that does not return in time is abandoned: its lease is released
// anyway, so its later guarded writes are refused. Run returns nil after a
// clean stop.
//
// Run first checks that the schema is migrated (a
// *migrations.NotMigratedError if not); if ctx ends before that check
// completes, Run returns nil. A permanent database error later
// (a dropped table, revoked privileges: see package lock for the
// classification) stops every job the same graceful way and is returned;
// transient errors are retried.
func (r *Runner) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.running {
		r.mu.Unlock()
		return ErrRunning
	}
	r.running = true
	jobs := append([]*job(nil), r.jobs...)
	r.mu.Unlock()

	if err := r.verify(ctx); err != nil {
		if ctx.Err() != nil {
			return nil // stopped while starting: a clean stop, as Election.Run's
		}
		return err
	}
	if reg, err := r.m.observe(); err == nil {
		defer func() { _ = reg.Unregister() }()
	}
	work, stopWork := context.WithCancelCause(context.Background())
	var (
		fatalOnce sync.Once
		fatalErr  error
	)
	r.fatal = func(err error) {
		fatalOnce.Do(func() {
			fatalErr = err
			r.log.Error("pgfence runner: stopping on a permanent error", "err", err)
			stopWork(err)
		})
	}
	var wg sync.WaitGroup
	var sharded []*job
	for _, j := range jobs {
		if j.shards > 0 {
			sharded = append(sharded, j)
			continue
		}
		w := &worker{r: r, j: j}
		wg.Add(1)
		go func() { defer wg.Done(); w.loop(work) }()
	}
	if len(sharded) > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); r.balance(work, sharded) }()
	}
	wg.Add(1)
	go func() { defer wg.Done(); r.prune(work) }()

	select {
	case <-ctx.Done():
	case <-work.Done():
	}
	stopWork(errShutdown)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(r.cfg.ShutdownTimeout):
		r.log.Warn("pgfence runner: jobs did not stop within ShutdownTimeout; releasing their leases anyway")
	}
	cctx, cancel := context.WithTimeout(context.Background(), wait.CleanupTimeout)
	defer cancel()
	_, _ = r.pool.Exec(cctx, r.q.leave, r.cfg.Lock.Holder, membersName)
	if err := r.lc.Close(cctx); err != nil && fatalErr == nil {
		return err
	}
	return fatalErr
}

// verify checks the schema, retrying transient errors until ctx ends.
func (r *Runner) verify(ctx context.Context) error {
	b := retry.Backoff{Base: r.cfg.Lock.PollInterval, Max: 10 * r.cfg.Lock.PollInterval}
	for n := 0; ; n++ {
		err := migrations.Verify(ctx, r.pool, r.cfg.Lock.Schema)
		if err == nil || !retry.Transient(err) {
			if err != nil {
				return fmt.Errorf("runner: %w", err)
			}
			return nil
		}
		if n == 0 {
			r.log.Warn("pgfence runner: cannot check the schema yet; retrying", "err", err)
		}
		if !wait.Sleep(ctx, b.Wait(n)) {
			return ctx.Err()
		}
	}
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

package runner

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/lock"
)

// Runner runs registered jobs so that each slot of each job (and shard) runs
// on exactly one of the replicas that run the same Runner, fenced by the
// job's lease token. Register jobs, then call Run on every replica.
type Runner struct {
	pool *pgxpool.Pool
	cfg  Config
	q    queries
	lc   *lock.Client

	mu      sync.Mutex
	jobs    []*job
	names   map[string]bool
	running bool
}

type job struct {
	Job
	sched  Schedule
	shards int // 0: singleton
}

// ErrNilPool is returned by New for a nil pool.
var ErrNilPool = errors.New("runner: nil pool")

// New returns a runner on pool's database. It validates cfg (see Config for
// the defaults) and returns a *ConfigError (or a *lock.ConfigError for the
// lease timings) naming the bad field.
func New(pool *pgxpool.Pool, cfg Config) (*Runner, error) {
	if pool == nil {
		return nil, ErrNilPool
	}
	if cfg.TTL < 0 || cfg.RebalanceInterval < 0 || cfg.PollInterval < 0 || cfg.RenewInterval < 0 {
		return nil, &ConfigError{"TTL", "durations must not be negative"}
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	lc, err := lock.New(pool, lock.Config{TTL: cfg.TTL, RenewInterval: cfg.RenewInterval,
		PollInterval: cfg.PollInterval, Holder: cfg.Instance, Schema: cfg.Schema, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	cfg.Instance = lc.Config().Holder
	return &Runner{pool: pool, cfg: cfg, q: newQueries(cfg.Schema), lc: lc, names: make(map[string]bool)}, nil
}

// Instance returns this runner's instance identity.
func (r *Runner) Instance() string { return r.cfg.Instance }

// Register adds a singleton job: each slot runs on exactly one replica. It
// returns ErrInvalidJob / ErrInvalidSchedule (naming the problem),
// ErrDuplicateJob, or ErrRunning.
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
func (r *Runner) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.running {
		r.mu.Unlock()
		return ErrRunning
	}
	r.running = true
	jobs := append([]*job(nil), r.jobs...)
	r.mu.Unlock()

	work, stopWork := context.WithCancelCause(context.Background())
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

	<-ctx.Done()
	stopWork(errShutdown)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(r.cfg.ShutdownTimeout):
		r.cfg.Logger.Warn("pgfence runner: jobs did not stop within ShutdownTimeout; releasing their leases anyway")
	}
	cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = r.pool.Exec(cctx, r.q.leave, r.cfg.Instance)
	return r.lc.Close(cctx)
}

func (r *Runner) emit(e Event) {
	if r.cfg.OnEvent != nil {
		r.cfg.OnEvent(e)
	}
}

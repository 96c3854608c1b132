package runner_test

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

func TestMain(m *testing.M) {
	if os.Getenv(fleetEnv) != "" {
		os.Exit(fleetMember()) // a service process of TestFleet
	}
	if os.Getenv(spreadEnv) != "" {
		os.Exit(spreadReplica()) // a replica of TestSingletonsSpreadOverReplicas
	}
	if os.Getenv(steerEnv) != "" {
		os.Exit(steeredReplica()) // a replica of TestSteeringWithAFrozenLeader
	}
	pgtest.Main(m)
}

var quiet = pgtest.Quiet

// instance is one runner replica running in the test.
type instance struct {
	r      *runner.Runner
	cancel context.CancelFunc
	done   chan struct{} // closed when Run has returned (err set)
	err    error
}

func (in *instance) stop(t testing.TB) {
	t.Helper()
	in.cancel()
	select {
	case <-in.done:
		if in.err != nil {
			t.Errorf("Run: %v", in.err)
		}
	case <-time.After(30 * time.Second):
		t.Error("Run did not return")
	}
}

// events collects runner events from every instance.
type events struct {
	mu  sync.Mutex
	all []runner.Event
	who []string
	fn  func(who string, e runner.Event)
}

func (ev *events) hook(who string) func(runner.Event) {
	return func(e runner.Event) {
		ev.mu.Lock()
		ev.all = append(ev.all, e)
		ev.who = append(ev.who, who)
		fn := ev.fn
		ev.mu.Unlock()
		if fn != nil {
			fn(who, e)
		}
	}
}

func (ev *events) count(k runner.EventKind) int {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	n := 0
	for _, e := range ev.all {
		if e.Kind == k {
			n++
		}
	}
	return n
}

// service is a service process of a test: it reads "schema instance
// [args...]" from its environment variable, runs until SIGTERM, and builds
// its runner on a pool and lock client of its own (the given TTL, polls
// every 100ms).
type service struct {
	ctx        context.Context
	schema, id string
	args       []string
	r          *runner.Runner
	pool       *pgxpool.Pool
	close      func()
}

func newService(env string, ttl time.Duration, cfg runner.Config) (*service, error) {
	f := strings.Fields(os.Getenv(env))
	if len(f) < 2 {
		return nil, fmt.Errorf("%s=%q: want schema and instance", env, os.Getenv(env))
	}
	s := &service{schema: f[0], id: f[1], args: f[2:]}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	s.ctx = ctx
	pool, err := pgxpool.New(ctx, os.Getenv(pgtest.EnvURL))
	if err != nil {
		stop()
		return nil, err
	}
	client, err := lock.New(pool, lock.Config{Schema: s.schema, Holder: s.id, TTL: ttl, PollInterval: 100 * time.Millisecond, Logger: quiet})
	if err != nil {
		pool.Close()
		stop()
		return nil, err
	}
	s.pool, s.close = pool, func() { _ = client.Close(context.Background()); pool.Close(); stop() }
	if s.r, err = runner.New(client, cfg); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// table is the quoted name of table in the service's schema.
func (s *service) table(name string) string { return pgx.Identifier{s.schema, name}.Sanitize() }

// exit reports err, if any, as the process's failure: its exit code.
func exit(what string, err error) int {
	if err != nil {
		fmt.Fprintln(os.Stderr, what+":", err)
		return 1
	}
	return 0
}

// slots lists the slots of the events of kind k, in order.
func (ev *events) slots(k runner.EventKind) []time.Time {
	ev.mu.Lock()
	defer ev.mu.Unlock()
	var s []time.Time
	for _, e := range ev.all {
		if e.Kind == k {
			s = append(s, e.Slot)
		}
	}
	return s
}

// lockClient returns a lock client on pool (with a quiet logger unless cfg
// names one), closed when the test ends, or fails the test.
func lockClient(t testing.TB, pool *pgxpool.Pool, cfg lock.Config) *lock.Client {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	c, err := lock.New(pool, cfg)
	if err != nil {
		t.Fatalf("lock.New: %v", err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// start builds and runs a runner on its own lock client; it is stopped
// when the test ends.
func start(t testing.TB, pool *pgxpool.Pool, lcfg lock.Config, cfg runner.Config, register func(r *runner.Runner) error) *instance {
	t.Helper()
	r, err := runner.New(lockClient(t, pool, lcfg), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := register(r); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	in := &instance{r: r, cancel: cancel, done: make(chan struct{})}
	go func() { in.err = r.Run(ctx); close(in.done) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-in.done:
		case <-time.After(30 * time.Second):
			buf := make([]byte, 1<<20)
			t.Errorf("Run did not return within 30s of cancel:\n%s", buf[:runtime.Stack(buf, true)])
		}
	})
	return in
}

// startWith is start with the configurations cfg makes for instance who.
func startWith(t testing.TB, pool *pgxpool.Pool, who string, cfg func(string) (lock.Config, runner.Config), register func(r *runner.Runner) error) *instance {
	t.Helper()
	lc, rc := cfg(who)
	return start(t, pool, lc, rc, register)
}

func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	pgtest.Eventually(t, d, what, cond)
}

func tbl(db *pgtest.DB, name string) string { return pgx.Identifier{db.Schema, name}.Sanitize() }

func queryInt(t testing.TB, db *pgtest.DB, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

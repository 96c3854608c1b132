package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

// A partition worker runs one scenario inside a network namespace of its
// own (partition_test.go), against the suite's server through the
// namespace's link. It speaks with the test in JSON lines: it writes
// {"step": ..., fields} on stdout, and where it must wait for the test (to
// cut or heal the network) it reads one line from stdin first. Times are
// Unix nanoseconds of the machine's clock, which the test shares.

// msg is one line a partition worker writes.
type msg map[string]any

// ctl is the worker's side of the conversation.
type ctl struct {
	mu  sync.Mutex
	out *json.Encoder
	in  *bufio.Scanner
}

// say writes a step.
func (c *ctl) say(step string, m msg) {
	if m == nil {
		m = msg{}
	}
	m["step"] = step
	c.mu.Lock()
	defer c.mu.Unlock()
	_ = c.out.Encode(m)
}

// await writes a step and waits for the test's go-ahead.
func (c *ctl) await(step string, m msg) { c.say(step, m); c.read() }

// read returns the test's next line.
func (c *ctl) read() string {
	if !c.in.Scan() {
		os.Exit(3) // the test is gone
	}
	return c.in.Text()
}

// call is one timed library call: when it started, its deadline, when it
// returned, and what it returned.
func call(ctx context.Context, budget time.Duration, f func(ctx context.Context) error) (msg, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	deadline, _ := ctx.Deadline()
	err := f(ctx)
	m := msg{"start": start.UnixNano(), "deadline": deadline.UnixNano(), "ret": time.Now().UnixNano(),
		"late_ms": float64(time.Since(deadline).Microseconds()) / 1000}
	describe(m, err)
	return m, err
}

// describe puts what the test checks of an error into m.
func describe(m msg, err error) {
	m["ok"] = err == nil
	if err != nil {
		m["err"] = err.Error()
	}
	m["unknown"] = errors.Is(err, fence.ErrOutcomeUnknown)
	m["fenced"] = errors.Is(err, fence.ErrFenced)
	m["own"] = errors.Is(err, errOwn)
}

// errOwn is the error of a function's own that a scenario returns.
var errOwn = errors.New("the function's own error")

func envDuration(name string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv(name)); err == nil {
		return d
	}
	return def
}

// logTo is where the worker's client logs: stderr, which the test shows
// when it fails, or nowhere.
func logTo() io.Writer {
	if os.Getenv("PART_LOG") == "1" {
		return os.Stderr
	}
	return io.Discard
}

func partitionWorkerMain() int {
	c := &ctl{out: json.NewEncoder(os.Stdout), in: bufio.NewScanner(os.Stdin)}
	fail := func(err error) int {
		c.say("fatal", msg{"err": err.Error()})
		return 1
	}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("PART_URL"))
	if err != nil {
		return fail(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "partition-worker"
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	ttl := envDuration("PART_TTL", 10*time.Second)
	lc, err := lock.New(pool, lock.Config{Schema: "pgfence", TTL: ttl, RenewInterval: ttl / 4,
		PollInterval: envDuration("PART_POLL", 100*time.Millisecond), Holder: "partitioned",
		Logger: slog.New(slog.NewTextHandler(logTo(), nil))})
	if err != nil {
		return fail(err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_ = lc.Close(cctx)
	}()
	budget := envDuration("PART_BUDGET", 3*time.Second)
	switch s := os.Getenv("PART_SCENARIO"); s {
	case "tx":
		err = partitionedTx(ctx, c, lc, budget, os.Getenv("PART_END"))
	case "hold":
		err = partitionedHolder(ctx, c, lc)
	case "ops":
		err = partitionedOps(ctx, c, lc, budget)
	case "listen":
		err = partitionedWaiter(ctx, c, lc)
	case "leader":
		err = partitionedLeader(ctx, c, lc)
	case "many":
		err = partitionedMany(ctx, c, lc)
	default:
		err = fmt.Errorf("unknown scenario %q", s)
	}
	if err != nil {
		return fail(err)
	}
	c.say("bye", nil)
	return 0
}

// partitionedTx runs one guarded transaction that inserts a marker row, and
// waits inside it for the test to cut the network; then its function ends
// as end says:
//   - "own-error": it returns an error of its own;
//   - "commit": it returns nil, so COMMIT goes into the partition;
//   - "after-heal": it waits for the test to heal the network, then returns
//     nil;
//   - "blocked": it runs a statement that cannot finish (pg_sleep), which
//     ends with the deadline or the lease.
//
// It reports what RunTx returned and when; after the heal, an unknown
// outcome is resolved and reported.
func partitionedTx(ctx context.Context, c *ctl, lc *lock.Client, budget time.Duration, end string) error {
	l, err := lc.Acquire(ctx, "partitioned")
	if err != nil {
		return err
	}
	marker, _ := strconv.ParseInt(os.Getenv("PART_MARKER"), 10, 64)
	res, err := call(ctx, budget, func(ctx context.Context) error {
		return l.RunTx(ctx, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO data.partitioned (marker) VALUES ($1)", marker); err != nil {
				return err
			}
			c.await("inside", nil)
			switch end {
			case "own-error":
				return errOwn
			case "after-heal":
				c.await("partitioned", nil)
			case "blocked":
				_, err := tx.Exec(ctx, "SELECT pg_sleep(60)")
				return err
			}
			return nil
		})
	})
	res["lease_live"] = l.Err() == nil
	c.await("returned", res)
	if res["unknown"] == true {
		var u *fence.UnknownOutcomeError
		rerr := errors.New("no *fence.UnknownOutcomeError in the error")
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if errors.As(err, &u) {
			rerr = u.Resolve(rctx, lc.Pool())
		}
		m := msg{}
		describe(m, rerr)
		c.say("resolved", m)
	}
	return nil
}

// partitionedHolder holds a lease, reports when it stops trusting it, and
// after the heal tries a guarded write with it.
func partitionedHolder(ctx context.Context, c *ctl, lc *lock.Client) error {
	l, err := lc.Acquire(ctx, "held")
	if err != nil {
		return err
	}
	c.say("held", msg{"token": l.Token().String()})
	<-l.Done()
	c.await("lost", msg{"at": time.Now().UnixNano(), "err": l.Err().Error()})
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err = l.Guard().RunTx(wctx, lc.Pool(), func(tx pgx.Tx) error {
		_, err := tx.Exec(wctx, "INSERT INTO data.partitioned (marker) VALUES (-1)")
		return err
	})
	m := msg{}
	describe(m, err)
	c.say("write", m)
	return nil
}

// partitionedOps holds leases and starts a ForceRelease of a lease the
// test holds inside an open guarded transaction (so the statement waits),
// waits for the test to cut the network, then makes each call that must
// return by its deadline whatever the network does, reporting each: some
// with a live deadline, some with a context that has already ended (a
// shutdown's cleanup).
func partitionedOps(ctx context.Context, c *ctl, lc *lock.Client, budget time.Duration) error {
	pool := lc.Pool()
	var held []*lock.Lease
	tag := os.Getenv("PART_TAG") // a run's own lease names: an earlier run's may still be held
	for _, name := range []string{"ops-1-" + tag, "ops-2-" + tag, "ops-3-" + tag} {
		l, err := lc.Acquire(ctx, name)
		if err != nil {
			return err
		}
		held = append(held, l)
	}
	forced := make(chan msg, 1)
	go func() {
		m, _ := call(ctx, 2*budget, func(ctx context.Context) error {
			_, err := lock.ForceRelease(ctx, lc.Pool(), "pgfence", "ops-root")
			return err
		})
		forced <- m
	}()
	c.await("held", nil)
	ended := func(f func(ctx context.Context) error) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			<-ctx.Done()
			return f(ctx)
		}
	}
	calls := []struct {
		name string
		f    func(ctx context.Context) error
	}{
		{"release", held[0].Release},
		{"release-ended", ended(held[2].Release)},
		{"check", held[1].Check},
		{"acquire", func(ctx context.Context) error {
			_, err := lc.Acquire(ctx, "ops-root") // the test holds it
			return err
		}},
		{"try-acquire", func(ctx context.Context) error {
			_, err := lc.TryAcquire(ctx, "ops-free-"+tag)
			return err
		}},
		{"observe", func(ctx context.Context) error {
			ch, err := lc.Observe(ctx, "ops-root")
			if err != nil {
				return err
			}
			for range ch { // closed when ctx ends
			}
			return ctx.Err()
		}},
		{"inspect", func(ctx context.Context) error {
			_, err := lock.Inspect(ctx, pool, "pgfence", "ops-root")
			return err
		}},
		{"leases", func(ctx context.Context) error {
			_, err := lock.Leases(ctx, pool, "pgfence")
			return err
		}},
		{"run-now", func(ctx context.Context) error {
			_, err := runner.RunNow(ctx, pool, "pgfence", "ops-job", 0, "partitioned")
			return err
		}},
		{"pause", func(ctx context.Context) error { return runner.Pause(ctx, pool, "pgfence", "ops-job", "partitioned") }},
		{"resume", func(ctx context.Context) error { return runner.Resume(ctx, pool, "pgfence", "ops-job") }},
		{"jobs", func(ctx context.Context) error {
			_, err := runner.Jobs(ctx, pool, "pgfence", "")
			return err
		}},
		{"grant-app", func(ctx context.Context) error { return migrations.GrantApp(ctx, pool, "pgfence", "postgres") }},
		{"migrate", func(ctx context.Context) error {
			_, err := migrations.Up(ctx, pool, "pgfence")
			return err
		}},
		{"close-ended", ended(lc.Close)},
	}
	for _, k := range calls {
		m, _ := call(ctx, budget, k.f)
		c.say(k.name, m)
	}
	c.say("force-release", <-forced)
	return nil
}

// partitionedWaiter waits to acquire a lease the test holds, through a
// partition of its release listener, and reports when it got it.
func partitionedWaiter(ctx context.Context, c *ctl, lc *lock.Client) error {
	got := make(chan msg, 1)
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	go func() {
		l, err := lc.Acquire(wctx, "waited")
		m := msg{"at": time.Now().UnixNano()}
		describe(m, err)
		if err == nil {
			_ = l.Release(ctx)
		}
		got <- m
	}()
	c.say("waiting", nil)
	c.say("acquired", <-got)
	return nil
}

// partitionedLeader leads a runner job whose run, once started, waits for
// its lease to end (the test cuts the network meanwhile), reports it, and
// after the test has healed the network tries to record the slot as done
// with the run's fenced CommitTx, as a zombie leader would; then it stops.
func partitionedLeader(ctx context.Context, c *ctl, lc *lock.Client) error {
	r, err := runner.New(lc, runner.Config{RebalanceInterval: time.Second, ShutdownTimeout: 2 * time.Second})
	if err != nil {
		return err
	}
	finished := make(chan struct{})
	var once sync.Once
	err = r.Register(runner.Job{Name: "partitioned-job", Schedule: "@every 1h", Run: func(ctx context.Context, run *runner.Run) error {
		c.say("running", msg{"slot": run.Slot.Format(time.RFC3339Nano), "token": run.Token.String()})
		<-ctx.Done()
		c.await("fenced", msg{"at": time.Now().UnixNano(), "err": context.Cause(ctx).Error()})
		wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		err := run.CommitTx(wctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(wctx, "INSERT INTO data.runs (slot, by) VALUES ($1, 'partitioned')", run.Slot)
			return err
		})
		m := msg{}
		describe(m, err)
		c.say("commit", m)
		once.Do(func() { close(finished) })
		return err
	}})
	if err != nil {
		return err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	<-finished
	cancel()
	return <-done
}

// partitionedMany acquires PART_COUNT leases (8 goroutines), holds them
// while the test cuts the network a few times (telling the test when its
// renewals have caught up after each heal), and reports how many it lost.
func partitionedMany(ctx context.Context, c *ctl, lc *lock.Client) error {
	n, _ := strconv.Atoi(os.Getenv("PART_COUNT"))
	leases := make([]*lock.Lease, n)
	errs := make(chan error, 8)
	for g := range 8 {
		go func() {
			for i := g; i < n; i += 8 {
				l, err := lc.TryAcquire(ctx, fmt.Sprintf("many-%d", i))
				if err != nil {
					errs <- err
					return
				}
				leases[i] = l
			}
			errs <- nil
		}()
	}
	for range 8 {
		if err := <-errs; err != nil {
			return err
		}
	}
	c.say("held", nil)
	// "sync": wait for two renewals to succeed (after a heal); anything
	// else: count the losses.
	for c.read() == "sync" {
		first := lc.Stats().Renewals
		deadline := time.Now().Add(30 * time.Second)
		for lc.Stats().Renewals < first+2 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		c.say("synced", msg{"renewals": lc.Stats().Renewals - first})
	}
	lost := 0
	for _, l := range leases {
		if l.Err() != nil {
			lost++
		}
	}
	c.say("lost", msg{"lost": lost})
	return nil
}

package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// newPool opens a pool of at most maxConns connections whose statements are
// counted.
func (b *bench) newPool(ctx context.Context, maxConns int32, tune ...func(*pgxpool.Config)) (*pgxpool.Pool, *counter, error) {
	cfg, err := pgxpool.ParseConfig(b.url)
	if err != nil {
		return nil, nil, err
	}
	cfg.MaxConns = maxConns
	for _, t := range tune {
		t(cfg)
	}
	sent := &counter{}
	cfg.ConnConfig.Tracer = sent
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	return pool, sent, err
}

// scale measures one client holding many leases: what its renewals send and
// cost, and its memory per lease.
func (b *bench) scale(ctx context.Context, out *bytes.Buffer, ttl time.Duration, intervals int, counts ...int) error {
	renew := ttl / 3
	fmt.Fprintf(out, "\n### Scale: one client holding many leases\n\nOne client (TTL %s, so a renewal every %s; a pool of %d) acquires "+
		"the leases (%d goroutines), then holds them for %d renewal intervals. Statements: what it sent per interval (a pgx tracer; "+
		"a renewal is one statement of the client's session, whatever the number of leases). Renew latency: the renewal's round "+
		"trip (`Client.Stats`), median and max over the window. Server CPU: every `postgres` process, per second of holding. Heap: "+
		"the client's live heap after a GC, with the leases minus without, per lease (with one lease: mostly the client's own "+
		"structures). Close: `Client.Close`, which releases them all and ends the session.\n\n"+
		"Lost: leases that ended while they were acquired or held (none should), counted from `Config.OnEvent`.\n\n"+
		"| leases | statements / renewal interval | renew latency | server CPU / s | lost | client heap / lease | acquiring them | Close |\n"+
		"|---|---|---|---|---|---|---|---|\n", ttl, renew, acquirers, acquirers, intervals)
	for _, n := range counts {
		r, err := b.holdOnce(ctx, holdCase{leases: n, ttl: ttl, intervals: intervals, acquirers: acquirers, pool: acquirers})
		if err != nil {
			return fmt.Errorf("scale %d: %w", n, err)
		}
		fmt.Fprintf(out, "| %d | %.1f | %s (max %s) | %s | %s | %.0f B | %s | %s |\n", n, r.statements,
			ms(r.latency[len(r.latency)/2]), ms(r.latency[len(r.latency)-1]), r.serverText(), r.lostText(), r.heapPerLease,
			r.acquiring.Round(time.Millisecond), r.closing.Round(time.Millisecond))
	}
	return nil
}

// acquirers is how many goroutines acquire the leases of a scale row: as
// many as an independent probe used, which saw 81-87% of 100,000 leases at
// a 3 s TTL lost while they acquired (before sessions).
const acquirers = 16

// manyLeases is scale with 100,000 leases at the default TTL and at 3 s.
func (b *bench) manyLeases(ctx context.Context, out *bytes.Buffer) error {
	for _, ttl := range []time.Duration{15 * time.Second, 3 * time.Second} {
		if err := b.scale(ctx, out, ttl, 10, 100000); err != nil {
			return err
		}
	}
	return nil
}

// holdCase is one client holding many leases: how many, its TTL, how many
// renewal intervals it holds them, how many goroutines acquire them, and
// its pool's size.
type holdCase struct {
	leases, intervals, acquirers int
	pool                         int32
	ttl                          time.Duration
}

// holdResult is what one holdCase measured.
type holdResult struct {
	statements          float64         // per renewal interval, while holding
	latency             []time.Duration // renewal round trips, sorted
	cpu, took           time.Duration   // server CPU while holding, and the window
	lostAcquiring, lost int
	why                 map[LossWhy]int
	renewals, slow      uint64
	heapPerLease        float64
	acquiring, closing  time.Duration
}

func (r holdResult) serverCPU() float64 {
	return float64(r.cpu.Microseconds()) / 1000 / r.took.Seconds()
}

func (r holdResult) serverText() string {
	if r.cpu < 0 {
		return "–"
	}
	return fmt.Sprintf("%.0f ms", r.serverCPU())
}

func (r holdResult) lostText() string {
	if r.lost == 0 {
		return "0"
	}
	return fmt.Sprintf("**%d**, %d of them while acquiring (%v; slow renewals: %d of %d)", r.lost, r.lostAcquiring, r.why, r.slow, r.renewals)
}

// holdOnce runs one holdCase. Leases lost are a result, not an error.
func (b *bench) holdOnce(ctx context.Context, hc holdCase) (holdResult, error) {
	var r holdResult
	pool, sent, err := b.newPool(ctx, hc.pool)
	if err != nil {
		return r, err
	}
	defer pool.Close()
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	var lost atomic.Int64
	c, err := lock.New(pool, lock.Config{Schema: schema, TTL: hc.ttl, Holder: "bench-scale", Logger: quiet,
		OnEvent: func(e lock.Event) {
			if e.Kind == lock.Lost {
				lost.Add(1)
			}
		}})
	if err != nil {
		return r, err
	}
	open := true // Close is measured below; on an error return, close here
	defer func() {
		if open {
			_ = c.Close(context.Background())
		}
	}()
	// Stats read every 2 ms throughout, as a busy exporter would.
	stop := make(chan struct{})
	var readers sync.WaitGroup
	readers.Add(1)
	go func() {
		defer readers.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
				_ = c.Stats()
			}
		}
	}()
	defer func() { close(stop); readers.Wait() }()
	prefix := fmt.Sprintf("scale-%d-%s-", hc.leases, randName())
	heap0 := heap()
	leases := make([]*lock.Lease, hc.leases)
	began := time.Now()
	if err := parallel(hc.acquirers, hc.leases, func(i int) error {
		l, err := c.TryAcquire(ctx, prefix+fmt.Sprint(i))
		leases[i] = l
		return err
	}); err != nil {
		return r, err
	}
	r.acquiring = time.Since(began)
	r.lostAcquiring = int(lost.Load())
	r.heapPerLease = (float64(heap()) - float64(heap0)) / float64(hc.leases)
	renewals := func() uint64 { return c.Stats().Renewals }
	r0 := renewals()
	if err := waitUntil(2*hc.ttl, func() bool { return renewals() > r0 }); err != nil {
		return r, errors.New("no renewal")
	}
	s0, cpu0, t0 := sent.statements.Load(), mustCPU(), time.Now()
	for end := t0.Add(time.Duration(hc.intervals) * c.Config().RenewInterval); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if st := c.Stats(); len(r.latency) == 0 || st.LastRenewLatency != r.latency[len(r.latency)-1] {
			r.latency = append(r.latency, st.LastRenewLatency)
		}
	}
	r.took, r.cpu = time.Since(t0), mustCPU()-cpu0
	if cpu0 < 0 {
		r.cpu = -1
	}
	r.statements = float64(sent.statements.Load()-s0) / float64(hc.intervals)
	st := c.Stats()
	r.renewals, r.slow = st.Renewals, st.SlowRenewals
	r.lost = int(lost.Load())
	if held := hc.leases - st.Held; held > r.lost {
		r.lost = held
	}
	r.why = map[LossWhy]int{}
	for _, l := range leases {
		if err := l.Err(); err != nil {
			r.why[lossWhy(err)]++
		}
	}
	closing := time.Now()
	open = false
	if err := c.Close(ctx); err != nil {
		return r, err
	}
	r.closing = time.Since(closing)
	sort.Slice(r.latency, func(i, j int) bool { return r.latency[i] < r.latency[j] })
	return r, nil
}

// randName is a short random name part: each run's leases are new names.
func randName() string { return fmt.Sprintf("%06x", rand.IntN(1<<24)) }

// soak holds the cases of the lease-loss reports runs times each, in a row,
// with two CPU hogs on the machine (busy shell loops), and writes how many
// leases were lost in all, with the spread of the rest.
func (b *bench) soak(ctx context.Context, out *bytes.Buffer, runs, largeRuns int) error {
	hogs, err := startHogs(2)
	if err != nil {
		return err
	}
	defer stopHogs(hogs)
	cases := []holdCase{
		{leases: 10000, ttl: 3 * time.Second, intervals: 5, acquirers: 8, pool: 8},
		{leases: 10000, ttl: 3 * time.Second, intervals: 10, acquirers: 16, pool: 16},
		{leases: 100000, ttl: 3 * time.Second, intervals: 10, acquirers: 8, pool: 8},
		{leases: 100000, ttl: 3 * time.Second, intervals: 10, acquirers: 16, pool: 16},
	}
	fmt.Fprintf(out, "\n### Soak: one client acquiring and holding many leases at a 3 s TTL, two CPU hogs running\n\n"+
		"Each case run in a row (runs: the count), with two busy shell loops on the 2-core machine throughout. One client (TTL 3s, "+
		"RenewInterval 1s, defaults otherwise; `Stats` read every 2 ms) acquires the leases with `TryAcquire` from the "+
		"goroutines given, then holds them for the intervals given. Lost: leases lost while acquiring or holding, all runs "+
		"together (`Config.OnEvent`, and `Stats.Held` at the end). Statements and server CPU: while holding, per renewal "+
		"interval and per second, median [max] over the runs. Renew latency: the slowest renewal of all runs.\n\n"+
		"| leases | acquirers | pool | intervals held | runs | lost | acquiring them | statements / interval | server CPU / s | slowest renewal |\n"+
		"|---|---|---|---|---|---|---|---|---|---|\n")
	for _, hc := range cases {
		var (
			lost             int
			acq, stmts, cpus []float64
			slowest          time.Duration
		)
		n := runs
		if hc.leases > 10000 {
			n = largeRuns
		}
		for i := range n {
			r, err := b.holdOnce(ctx, hc)
			if err != nil {
				return fmt.Errorf("soak %d leases, run %d: %w", hc.leases, i, err)
			}
			lost += r.lost
			acq = append(acq, r.acquiring.Seconds())
			stmts = append(stmts, r.statements)
			cpus = append(cpus, r.serverCPU())
			slowest = max(slowest, r.latency[len(r.latency)-1])
			fmt.Fprintf(os.Stderr, "bench: soak %d leases, %d acquirers: run %d: lost %d, acquired in %s, %.1f statements/interval, %.0f ms CPU/s\n",
				hc.leases, hc.acquirers, i+1, r.lost, r.acquiring.Round(time.Millisecond), r.statements, r.serverCPU())
		}
		lostText := "0"
		if lost > 0 {
			lostText = fmt.Sprintf("**%d**", lost)
		}
		fmt.Fprintf(out, "| %d | %d | %d | %d | %d | %s | %s | %s | %s | %s |\n", hc.leases, hc.acquirers, hc.pool, hc.intervals, n, lostText,
			spread(acq, "%.1f s"), spread(stmts, "%.1f"), spread(cpus, "%.0f ms"), ms(slowest))
	}
	return nil
}

// spread is the median of xs and its max, in format f.
func spread(xs []float64, f string) string {
	s := slices.Clone(xs)
	slices.Sort(s)
	return fmt.Sprintf(f+" ["+f+"]", s[len(s)/2], s[len(s)-1])
}

// startHogs starts n processes that spin on a CPU each.
func startHogs(n int) ([]*exec.Cmd, error) {
	var hogs []*exec.Cmd
	for range n {
		h := exec.Command("sh", "-c", "while :; do :; done")
		if err := h.Start(); err != nil {
			stopHogs(hogs)
			return nil, err
		}
		hogs = append(hogs, h)
	}
	return hogs, nil
}

// stopHogs kills the hogs and waits for them.
func stopHogs(hogs []*exec.Cmd) {
	for _, h := range hogs {
		_ = h.Process.Kill()
		_ = h.Wait()
	}
}

// mustCPU is serverCPU, or -1 when it is not known.
func mustCPU() time.Duration {
	if d, ok := serverCPU(); ok {
		return d
	}
	return -1
}

// parallel runs f(0..n-1) on workers goroutines and returns the first error.
func parallel(workers, n int, f func(i int) error) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		next  int
		first error
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				stop := i >= n || first != nil
				mu.Unlock()
				if stop {
					return
				}
				if err := f(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// waitUntil polls cond every 10 ms until it holds or limit passes.
func waitUntil(limit time.Duration, cond func() bool) error {
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// singletons runs 100 jobs on 10 runner instances, registered as singleton
// jobs and then as jobs of one shard, and writes what the fleet sends while
// every job has its leader and the other replicas wait, and how the jobs'
// leadership is spread.
func (b *bench) singletons(ctx context.Context, out *bytes.Buffer, window time.Duration, jobs int) error {
	const replicas = 10
	var got [2]fleetCost
	for i, sharded := range []bool{false, true} {
		c, err := b.fleet(ctx, replicas, jobs, sharded, window)
		if err != nil {
			return fmt.Errorf("singletons (sharded %t): %w", sharded, err)
		}
		got[i] = c
	}
	fmt.Fprintf(out, "\n### %d singleton jobs on %d runner replicas\n\nTen `runner` instances in this process, each with its own "+
		"4-connection pool and default timings (TTL 15 s, PollInterval 1 s, RebalanceInterval 5 s), register the same %d jobs "+
		"(`@every 1h`): with `Register`, and then with `RegisterSharded(job, 1)`. Once every job has its leader, for %s: what the "+
		"replicas' pools sent (every statement: the leaders' renewals and heartbeats, the waiters' polls, if any), the server's CPU, and "+
		"the connections they opened; with `Register`, once the jobs have moved to their preferred replicas (leadership held "+
		"still for 10 s). Then, in both forms: one replica leaves gracefully (its `Run` ends), and another is cut "+
		"off from the database (its connections terminated and no new ones allowed: it neither renews nor releases, as after a "+
		"crash); the time until each one's jobs are led again, and the jobs led per remaining replica once leadership has held "+
		"still for 10 s.\n\n| | `Register` | `RegisterSharded(job, 1)` |\n|---|---|---|\n", jobs, replicas, jobs, window)
	rows := []struct {
		label string
		cell  func(fleetCost) string
	}{
		{"every job led, after the replicas started", func(c fleetCost) string { return c.allLed.Round(10 * time.Millisecond).String() }},
		{"jobs led per replica", func(c fleetCost) string { return summary(c.led, "%.0f") }},
		{"statements / s, the whole fleet", func(c fleetCost) string { return fmt.Sprintf("%.1f", c.total) }},
		{"statements / s per replica", func(c fleetCost) string { return summary(c.perReplica, "%.2f") }},
		{"statements / s per waiting (replica, job) pair", func(c fleetCost) string {
			return fmt.Sprintf("%.4f", c.total/float64(jobs*(replicas-1)))
		}},
		{"server CPU / s", func(c fleetCost) string { return c.server }},
		{"new connections opened during the window", func(c fleetCost) string { return fmt.Sprint(c.newConns) }},
		{"graceful leave: its jobs led again after", func(c fleetCost) string {
			return orDash(c.afterLeave, func() string { return fmt.Sprintf("%v (%d jobs)", c.leaveTook.Round(time.Millisecond), c.leaveJobs) })
		}},
		{"jobs led per replica after the leave", func(c fleetCost) string {
			return orDash(c.afterLeave, func() string { return summary(c.afterLeave, "%.0f") })
		}},
		{"crash: its jobs led again after", func(c fleetCost) string {
			return orDash(c.afterCrash, func() string {
				return fmt.Sprintf("%v (%d jobs; TTL = 15 s)", c.crashTook.Round(time.Millisecond), c.crashJobs)
			})
		}},
		{"jobs led per replica after the crash", func(c fleetCost) string {
			return orDash(c.afterCrash, func() string { return summary(c.afterCrash, "%.0f") })
		}},
	}
	for _, r := range rows {
		fmt.Fprintf(out, "| %s | %s | %s |\n", r.label, r.cell(got[0]), r.cell(got[1]))
	}
	return nil
}

// orDash is s(), or "–" for a fleet that did not measure it.
func orDash(measured []float64, s func() string) string {
	if measured == nil {
		return "–"
	}
	return s()
}

// fleetCost is what a fleet of runners sent while its jobs were led, and
// how leadership moved after a graceful leave and a crash.
type fleetCost struct {
	allLed          time.Duration // from the replicas' start until every job had a leader
	led, perReplica []float64
	total           float64
	server          string
	newConns        int64

	leaveJobs, crashJobs   int
	leaveTook, crashTook   time.Duration
	afterLeave, afterCrash []float64
}

// fleet starts replicas runners with the same jobs jobs (singleton, or of
// one shard each), waits until every job has a leader, and measures the
// fleet for window.
func (b *bench) fleet(ctx context.Context, replicas, jobs int, sharded bool, window time.Duration) (fleetCost, error) {
	prefix := "single"
	if sharded {
		prefix = "sharded"
	}
	b.pool.Reset() // room for the fleet's connections
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type replica struct {
		pool   *pgxpool.Pool
		client *lock.Client
		sent   *counter
		stop   context.CancelFunc
		cut    *atomic.Bool // no new connections: the replica is partitioned away
		done   chan error
	}
	fleet := make([]*replica, replicas)
	defer func() {
		cancel()
		for _, r := range fleet {
			if r != nil {
				<-r.done
				_ = r.client.Close(context.Background())
				r.pool.Close()
			}
		}
	}()
	for i := range fleet {
		holder := fmt.Sprintf("%s-%d", prefix, i)
		cut := &atomic.Bool{}
		pool, sent, err := b.newPool(ctx, 4, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["application_name"] = holder
			c.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
				if cut.Load() {
					return errors.New("partitioned away")
				}
				return nil
			}
		})
		if err != nil {
			return fleetCost{}, err
		}
		client, err := lock.New(pool, lock.Config{Schema: schema, Holder: holder, Logger: quiet})
		if err != nil {
			pool.Close()
			return fleetCost{}, err
		}
		rctx, stop := context.WithCancel(ctx)
		r := &replica{pool: pool, client: client, sent: sent, stop: stop, cut: cut, done: make(chan error, 1)}
		run, err := runner.New(client, runner.Config{})
		if err == nil {
			for j := range jobs {
				job := runner.Job{Name: fmt.Sprintf("%s-%d", prefix, j), Schedule: "@every 1h", Missed: runner.Skip,
					Run: func(context.Context, *runner.Run) error { return nil }}
				if sharded {
					err = run.RegisterSharded(job, 1)
				} else {
					err = run.Register(job)
				}
				if err != nil {
					break
				}
			}
		}
		if err != nil {
			_ = client.Close(context.Background())
			pool.Close()
			return fleetCost{}, err
		}
		fleet[i] = r
		go func() { r.done <- run.Run(rctx) }()
	}
	began := time.Now()
	like := "pgfence/job/" + prefix + "-%"
	led := func() int {
		var n int
		_ = b.pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".pgfence_lease_states WHERE name LIKE $1 AND holder IS NOT NULL AND expires_at > now()", like).Scan(&n)
		return n
	}
	if err := waitUntil(time.Minute, func() bool { return led() == jobs }); err != nil {
		return fleetCost{}, fmt.Errorf("%d of %d jobs have a leader after a minute", led(), jobs)
	}
	allLed := time.Since(began)
	// leadsNow waits until the leadership has held still for two
	// RebalanceIntervals (10 s) and returns the jobs led per replica.
	leadsNow := func(skip ...int) ([]float64, error) {
		last, since := "", time.Now()
		var per map[string]int
		err := waitUntil(2*time.Minute, func() bool {
			per = map[string]int{}
			rows, err := b.pool.Query(ctx, "SELECT holder, count(*) FROM "+schema+".pgfence_lease_states WHERE name LIKE $1 AND holder IS NOT NULL "+
				"AND expires_at > now() GROUP BY holder ORDER BY holder", like)
			if err != nil {
				return false
			}
			n := 0
			for rows.Next() {
				var (
					h string
					k int
				)
				if rows.Scan(&h, &k) == nil {
					per[h], n = k, n+k
				}
			}
			if key := fmt.Sprint(per); key != last || n != jobs {
				last, since = key, time.Now()
			}
			return time.Since(since) > 10*time.Second
		})
		var out []float64
		for i := range fleet {
			if !slices.Contains(skip, i) {
				out = append(out, float64(per[fmt.Sprintf("%s-%d", prefix, i)]))
			}
		}
		return out, err
	}
	if !sharded {
		// Steady state: singleton jobs move to their preferred replicas
		// as the replicas' views settle.
		if _, err := leadsNow(); err != nil {
			return fleetCost{}, fmt.Errorf("singleton leadership did not settle: %w", err)
		}
	}
	time.Sleep(2 * time.Second) // the waiters are registered and polling
	leaders := map[string]int{}
	rows, err := b.pool.Query(ctx, "SELECT holder, count(*) FROM "+schema+".pgfence_leases WHERE name LIKE $1 AND holder IS NOT NULL GROUP BY holder", like)
	if err != nil {
		return fleetCost{}, err
	}
	for rows.Next() {
		var (
			h string
			k int
		)
		if err := rows.Scan(&h, &k); err != nil {
			return fleetCost{}, err
		}
		leaders[h] = k
	}
	if err := rows.Err(); err != nil {
		return fleetCost{}, err
	}
	s0, n0 := make([]int64, replicas), make([]int64, replicas)
	for i, r := range fleet {
		s0[i], n0[i] = r.sent.statements.Load(), r.pool.Stat().NewConnsCount()
	}
	cpu0, t0 := mustCPU(), time.Now()
	time.Sleep(window)
	took, cpu := time.Since(t0), mustCPU()-cpu0
	c := fleetCost{allLed: allLed}
	for i, r := range fleet {
		v := float64(r.sent.statements.Load()-s0[i]) / took.Seconds()
		c.perReplica = append(c.perReplica, v)
		c.total += v
		c.newConns += r.pool.Stat().NewConnsCount() - n0[i]
		c.led = append(c.led, float64(leaders[fmt.Sprintf("%s-%d", prefix, i)]))
	}
	if led() != jobs {
		return fleetCost{}, errors.New("a job lost its leader during the measurement")
	}
	c.server = "–"
	if cpu >= 0 {
		c.server = fmt.Sprintf("%.0f ms", float64(cpu.Microseconds())/1000/took.Seconds())
	}
	ledBy := func(holder string) int {
		var n int
		_ = b.pool.QueryRow(ctx, "SELECT count(*) FROM "+schema+".pgfence_lease_states WHERE name LIKE $1 AND holder = $2 AND expires_at > now()",
			like, holder).Scan(&n)
		return n
	}
	// A graceful leave: replica 0 stops (its Run releases its leases).
	c.leaveJobs = ledBy(prefix + "-0")
	left := time.Now()
	fleet[0].stop()
	if err := waitUntil(time.Minute, func() bool { return led() == jobs && ledBy(prefix+"-0") == 0 }); err != nil {
		return fleetCost{}, fmt.Errorf("after a graceful leave, %d of %d jobs have a leader", led(), jobs)
	}
	c.leaveTook = time.Since(left)
	if c.afterLeave, err = leadsNow(0); err != nil {
		return fleetCost{}, fmt.Errorf("after the leave: %w", err)
	}
	// A crash: replica 1 is cut off from the database (its connections
	// killed, no new ones), so it neither renews nor releases.
	victim := prefix + "-1"
	c.crashJobs = ledBy(victim)
	crashed := time.Now()
	fleet[1].cut.Store(true)
	if _, err := b.pool.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", victim); err != nil {
		return fleetCost{}, err
	}
	if err := waitUntil(2*time.Minute, func() bool { return led() == jobs && ledBy(victim) == 0 }); err != nil {
		return fleetCost{}, fmt.Errorf("after a crash, %d of %d jobs have a leader", led(), jobs)
	}
	c.crashTook = time.Since(crashed)
	if c.afterCrash, err = leadsNow(0, 1); err != nil {
		return fleetCost{}, fmt.Errorf("after the crash: %w", err)
	}
	return c, nil
}

// crashChild is the hidden mode of the crash-failover row: acquire name,
// say so on stdout, and hold it (renewing) until killed.
func crashChild(ctx context.Context, dbURL, name string, ttl time.Duration) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	c, err := lock.New(pool, lock.Config{Schema: schema, TTL: ttl, Holder: fmt.Sprintf("crash-child-%d", os.Getpid()), Logger: quiet})
	if err != nil {
		return err
	}
	l, err := c.Acquire(ctx, name)
	if err != nil {
		return err
	}
	fmt.Printf("held %d\n", l.Token())
	select {}
}

// crash measures failover after the holder's process is killed: from the
// SIGKILL to a waiting client's Acquire returning, against the TTL.
func (b *bench) crash(ctx context.Context, out *bytes.Buffer, rounds int) error {
	const ttl = 2 * time.Second
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	waiter, err := lock.New(b.pool, lock.Config{Schema: schema, TTL: ttl, Holder: "crash-waiter", Logger: quiet})
	if err != nil {
		return err
	}
	defer waiter.Close(context.Background())
	var takeover, afterExpiry []float64
	for i := range rounds {
		name := fmt.Sprintf("bench-crash-%d", i)
		cmd, line, err := startChild(ctx, exe, "-crash-child", name, "-crash-ttl", ttl.String(), "-database-url", b.url)
		if err != nil {
			return err
		}
		got := acquireAsync(ctx, waiter, name)
		// The waiter waits; the kill lands anywhere in the holder's renewal cycle.
		time.Sleep(300*time.Millisecond + rand.N(ttl/3))
		var left float64
		if err := b.pool.QueryRow(ctx, "SELECT extract(epoch FROM expires_at - now()) FROM "+schema+".pgfence_lease_states WHERE name = $1", name).Scan(&left); err != nil {
			return err
		}
		killed := time.Now()
		if err := cmd.Process.Kill(); err != nil {
			return err
		}
		_ = cmd.Wait()
		r := <-got
		if r.err != nil {
			return r.err
		}
		var old int64
		if _, err := fmt.Sscanf(line, "held %d", &old); err != nil {
			return fmt.Errorf("crash child said %q: %w", line, err)
		}
		if int64(r.l.Token()) <= old {
			return fmt.Errorf("crash: the new holder's token %d is not above the crashed holder's %d", r.l.Token(), old)
		}
		d := r.at.Sub(killed).Seconds()
		takeover = append(takeover, d*1000)
		afterExpiry = append(afterExpiry, (d-left)*1000)
		if err := r.l.Release(ctx); err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "\n### Crash failover vs the TTL\n\nA child process acquires a lease (TTL %s, renewed every %s) and is killed "+
		"(SIGKILL) while another client's `Acquire` waits for it (default PollInterval 1 s). Takeover: from the kill to that "+
		"`Acquire` returning. After expiry: the takeover minus what was left of the lease at the database (`expires_at - now()`, "+
		"read just before the kill). A graceful release hands over in the time of the handover table.\n\n"+
		"| holder | TTL | takeover after the kill, ms | after the lease expired, ms |\n|---|---|---|---|\n| pgfence | %s | %s | %s |\n",
		ttl, (ttl / 3).Round(time.Millisecond), ttl, summary(takeover, "%.0f"), summary(afterExpiry, "%.0f"))
	etcd, err := b.etcdCrash(ctx, rounds, ttl)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	fmt.Fprintf(out, "| etcd `Mutex` (session TTL; its keepalive every TTL/3) | %s | %s | – |\n", ttl, summary(etcd, "%.0f"))
	return nil
}

// childFlags are the hidden flags of the crash child.
func childFlags() (name *string, ttl *time.Duration) {
	return flag.String("crash-child", "", "internal: hold this lease until killed"),
		flag.Duration("crash-ttl", 2*time.Second, "internal: the crash child's TTL")
}

// LossWhy names why a lease ended, for the scale table.
type LossWhy string

// lossWhy sorts a lost lease's error into a few kinds.
func lossWhy(err error) LossWhy {
	switch msg := err.Error(); {
	case strings.Contains(msg, "trust window"):
		return "trust window ran out"
	case strings.Contains(msg, "taken over"):
		return "taken over"
	default:
		return "other"
	}
}

package ops

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// The replica process: the test binary run again with these variables.
const (
	replicaEnv       = "PGFENCE_OPS_REPLICA" // its holder name
	replicaURLEnv    = "PGFENCE_OPS_URL"
	replicaSchemaEnv = "PGFENCE_OPS_SCHEMA"
)

// faultTTL is the replicas' lease TTL: long enough that a slow renewal on
// a loaded machine is not a failure, short enough for the faults to be
// taken over quickly.
const faultTTL = 4 * time.Second

// replica is one pgfence replica with its metrics served for Prometheus:
// two jobs and a consumer group of 4 partitions, the same on every
// replica. It runs until ctx ends.
func replica(ctx context.Context, pool *pgxpool.Pool, schema, holder string, ready func(addr string)) error {
	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return err
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	defer mp.Shutdown(context.Background())
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{})}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()

	client, err := lock.New(pool, lock.Config{Schema: schema, Holder: holder, TTL: faultTTL,
		PollInterval: 50 * time.Millisecond, MeterProvider: mp, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	defer client.Close(context.Background())
	r, err := runner.New(client, runner.Config{RebalanceInterval: 500 * time.Millisecond})
	if err != nil {
		return err
	}
	ok := func(context.Context, *runner.Run) error { return nil }
	for _, j := range []runner.Job{{Name: "tick", Schedule: "@every 200ms", Run: ok}, {Name: "tock", Schedule: "@every 200ms", Run: ok}} {
		if err := r.Register(j); err != nil {
			return err
		}
	}
	end := func(context.Context, int) (int64, error) { return 0, nil }
	if err := r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 4, Poll: 100 * time.Millisecond, End: end,
		Consume: func(ctx context.Context, p *runner.Partition) error { return p.Wait(ctx) }}); err != nil {
		return err
	}
	ready(l.Addr().String())
	return r.Run(ctx)
}

// replicaMain runs a replica in this process, for the fault tests: it
// prints the address of its metrics and runs until killed or stopped.
func replicaMain() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv(replicaURLEnv))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer pool.Close()
	err = replica(ctx, pool, os.Getenv(replicaSchemaEnv), os.Getenv(replicaEnv), func(addr string) { fmt.Println("metrics", addr) })
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// replicaProc is a replica in a process of its own.
type replicaProc struct {
	cmd  *exec.Cmd
	addr string
}

// startReplica starts the replica holder in a process of its own (it dies
// with the test) and waits for its metrics' address.
func startReplica(t *testing.T, schema, holder string) *replicaProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), replicaEnv+"="+holder, replicaURLEnv+"="+pgtest.URL(t), replicaSchemaEnv+"="+schema)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() && stderr.Len() > 0 {
			t.Logf("replica %s:\n%s", holder, stderr.String())
		}
	})
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if addr, ok := strings.CutPrefix(sc.Text(), "metrics "); ok {
				lines <- addr
			}
		}
		_, _ = io.Copy(io.Discard, out)
	}()
	select {
	case addr := <-lines:
		return &replicaProc{cmd: cmd, addr: addr}
	case <-time.After(60 * time.Second):
		t.Fatalf("replica %s did not start: %s", holder, stderr.String())
		return nil
	}
}

// queryByInstance evaluates expr now and returns each result's labels,
// the instance included, as text.
func (p *promServer) queryByInstance(expr string) []string {
	p.t.Helper()
	var out []string
	for _, r := range p.results(expr) {
		var kv []string
		for k, v := range r {
			if k != "job" {
				kv = append(kv, k+"="+v)
			}
		}
		sort.Strings(kv)
		out = append(out, strings.Join(kv, ","))
	}
	sort.Strings(out)
	return out
}

// The shipped alerts under process faults, through a real Prometheus
// scraping two replicas (app-1 in the test, app-2 a process of its own):
// silent while healthy; a replica killed (kill -9) is taken over and
// leaves no alert firing (only the leaderless expressions may hold for
// less than their `for`, while its leases expire); a replica frozen
// (SIGSTOP) past its TTL and woken fires PgfenceLeaseLost for it, and
// nothing else.
func TestAlertsUnderProcessFaults(t *testing.T) {
	needPrometheus(t)
	db := pgtest.New(t)
	ctx := pgtest.Context(t, 4*time.Minute)
	rules := shippedAlerts(t)

	addr1 := make(chan string, 1)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- replica(rctx, db.Pool, db.Schema, "app-1", func(a string) { addr1 <- a }) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("replica app-1: %v", err)
		}
	})
	var a1 string
	select {
	case a1 = <-addr1:
	case err := <-done:
		t.Fatalf("replica app-1 stopped before it served its metrics: %v", err)
	}
	app2 := startReplica(t, db.Schema, "app-2")
	prom := startPrometheusOf(t, map[string]string{"app-1": a1, "app-2": app2.addr})

	firing := func() map[string][]string {
		out := map[string][]string{}
		for _, a := range rules {
			if res := prom.queryByInstance(a.Expr); len(res) > 0 {
				out[a.Alert] = res
			}
		}
		return out
	}
	// held counts the leases (jobs and partitions) each replica holds.
	held := func() map[string]int {
		n := map[string]int{}
		jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, j := range jobs {
			if j.Leader != "" {
				n[j.Leader]++
			}
		}
		parts, err := runner.Partitions(ctx, db.Pool, db.Schema, "relay")
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range parts {
			if p.Leading {
				n[p.Leader]++
			}
		}
		return n
	}
	const leases = 6 // 2 jobs and 4 partitions
	pgtest.Eventually(t, 60*time.Second, "both replicas leading, and scraped", func() bool {
		h := held()
		return h["app-1"]+h["app-2"] == leases && h["app-2"] > 0 && h["app-1"] > 0 &&
			len(prom.queryByInstance(`pgfence_lease_held`)) == 2
	})
	pgtest.Eventually(t, 60*time.Second, "no alert while healthy", func() bool { return len(firing()) == 0 })

	// kill -9 app-2: app-1 takes its leases over when they expire.
	// Meanwhile only the leaderless alerts may hold (their `for` is longer
	// than a TTL); afterwards, none.
	if err := app2.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	transient := map[string]bool{"PgfenceJobWithoutLeader": true, "PgfencePartitionWithoutLeader": true}
	seen := map[string]time.Time{} // each expression's first time non-empty
	last := map[string]time.Time{} // and its last
	look := func() map[string][]string {
		f := firing()
		now := time.Now()
		for a := range f {
			if _, ok := seen[a]; !ok {
				seen[a] = now
			}
			last[a] = now
		}
		return f
	}
	pgtest.Eventually(t, 60*time.Second, "app-1 to lead everything after app-2's kill", func() bool {
		look()
		return held()["app-1"] == leases
	})
	pgtest.Eventually(t, 30*time.Second, "no alert once app-1 leads everything", func() bool { return len(look()) == 0 })
	for a, from := range seen {
		if !transient[a] {
			t.Errorf("after kill -9 of a replica, %s fired; only the leaderless alerts may, briefly", a)
		}
		// Shorter than the alerts' `for: 1m`: they never fire.
		if held := last[a].Sub(from); held >= 30*time.Second {
			t.Errorf("after kill -9 of a replica, %s held for %v: long enough to fire", a, held)
		}
	}
	t.Logf("kill -9: took over; alert expressions seen meanwhile: %v", slices.Sorted(maps.Keys(seen)))
	clear(seen)

	// A new app-2 process (at a new address: a Prometheus of its own
	// scrapes it and app-1), then frozen past its TTL.
	app2b := startReplica(t, db.Schema, "app-2")
	prom2 := startPrometheusOf(t, map[string]string{"app-1": a1, "app-2": app2b.addr})
	pgtest.Eventually(t, 60*time.Second, "the new app-2 leading a share, and scraped", func() bool {
		return held()["app-2"] > 0 && len(prom2.queryByInstance(`pgfence_lease_held`)) == 2
	})
	prom = prom2
	pgtest.Eventually(t, 60*time.Second, "no alert before the freeze", func() bool { return len(firing()) == 0 })
	if err := app2b.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	frozeAt := time.Now()
	pgtest.Eventually(t, 60*time.Second, "app-1 to lead everything while app-2 is frozen", func() bool {
		return held()["app-1"] == leases
	})
	// Past the TTL, whatever was left of app-2's last renewal.
	time.Sleep(time.Until(frozeAt.Add(faultTTL + time.Second)))
	if err := app2b.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	var got map[string][]string
	pgtest.Eventually(t, 60*time.Second, "PgfenceLeaseLost for app-2 after it wakes", func() bool {
		got = firing()
		return len(got["PgfenceLeaseLost"]) > 0
	})
	// Held a while: what fires is the loss, on app-2, and nothing else.
	for range 5 {
		got = firing()
		for a, res := range got {
			switch {
			case a == "PgfenceLeaseLost":
				for _, r := range res {
					// Its trust window ran out while it was frozen (or, if its
					// renewal went first on waking, the lease was found taken).
					if !strings.Contains(r, "instance=app-2") ||
						!strings.Contains(r, "pgfence_cause=expired") && !strings.Contains(r, "pgfence_cause=taken_over") {
						t.Errorf("PgfenceLeaseLost for %s after app-2's freeze; want app-2's, cause expired or taken_over", r)
					}
				}
			case transient[a]: // app-2 hands leases back and forth on waking
			default:
				t.Errorf("after a freeze past the TTL, %s fired: %v", a, res)
			}
		}
		time.Sleep(time.Second) // a scrape and an evaluation apart
	}
	t.Logf("SIGSTOP past the TTL: %v", got)
}

package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.yaml.in/yaml/v3"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

func TestMain(m *testing.M) {
	if os.Getenv(replicaEnv) != "" {
		os.Exit(replicaMain())
	}
	pgtest.Main(m)
}

// metricName finds the series names in a rule's expression (not its
// labels, pgfence_job and the like).
var metricName = regexp.MustCompile(`pgfence_(lease|runner|guard)_[a-z_]+`)

// errNoPrometheus is the missing tool's error.
var errNoPrometheus = errors.New("the alert tests need Prometheus' promtool and server (Debian: apt-get install prometheus)")

func needPrometheus(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"promtool", "prometheus"} {
		if _, err := exec.LookPath(tool); err != nil {
			pgtest.NeedTool(t, fmt.Errorf("%w: %s not found", errNoPrometheus, tool), errNoPrometheus)
		}
	}
}

// The shipped rules are valid, and each alert fires for its fault and for
// nothing else (alerts-test.yml).
func TestRulesWithPromtool(t *testing.T) {
	needPrometheus(t)
	for _, args := range [][]string{{"check", "rules", "pgfence-alerts.yml"}, {"test", "rules", "alerts-test.yml"}} {
		if out, err := exec.Command("promtool", args...).CombinedOutput(); err != nil {
			t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// alertRule is one alert of the shipped rules.
type alertRule struct {
	Alert string `yaml:"alert"`
	Expr  string `yaml:"expr"`
}

func shippedAlerts(t *testing.T) []alertRule {
	t.Helper()
	b, err := os.ReadFile("pgfence-alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Groups []struct {
			Rules []alertRule `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	var rules []alertRule
	for _, g := range f.Groups {
		rules = append(rules, g.Rules...)
	}
	if len(rules) == 0 {
		t.Fatal("no alerts in pgfence-alerts.yml")
	}
	return rules
}

// promServer is a real Prometheus scraping one target every second.
type promServer struct {
	t    *testing.T
	base string
}

func startPrometheus(t *testing.T, target string) *promServer {
	t.Helper()
	return startPrometheusOf(t, map[string]string{"app-1": target})
}

// startPrometheusOf is startPrometheus scraping several targets, by their
// instance label.
func startPrometheusOf(t *testing.T, targets map[string]string) *promServer {
	t.Helper()
	dir := t.TempDir()
	rules, err := filepath.Abs("pgfence-alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	conf := fmt.Sprintf(`global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: [%q]
scrape_configs:
  - job_name: pgfence
    scrape_timeout: 900ms
    static_configs:
`, rules)
	for _, instance := range slices.Sorted(maps.Keys(targets)) {
		conf += fmt.Sprintf("      - {targets: [%q], labels: {instance: %s}}\n", targets[instance], instance)
	}
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	cmd := exec.Command("prometheus", "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address="+addr, "--log.level=warn")
	var logs strings.Builder
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("prometheus:\n%s", logs.String())
		}
	})
	p := &promServer{t: t, base: "http://" + addr}
	pgtest.Eventually(t, 30*time.Second, "Prometheus to be ready", func() bool {
		resp, err := http.Get(p.base + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return p
}

// query evaluates expr now and returns each result's labels as text.
func (p *promServer) query(expr string) []string {
	p.t.Helper()
	var out []string
	for _, m := range p.results(expr) {
		var kv []string
		for k, v := range m {
			if k != "instance" && k != "job" {
				kv = append(kv, k+"="+v)
			}
		}
		sort.Strings(kv)
		out = append(out, strings.Join(kv, ","))
	}
	sort.Strings(out)
	return out
}

// results evaluates expr now and returns each result's labels.
func (p *promServer) results(expr string) []map[string]string {
	p.t.Helper()
	resp, err := http.Get(p.base + "/api/v1/query?query=" + url.QueryEscape(expr))
	if err != nil {
		p.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var r struct {
		Status string
		Error  string
		Data   struct {
			Result []struct {
				Metric map[string]string
			}
		}
	}
	if err := json.Unmarshal(body, &r); err != nil || r.Status != "success" {
		p.t.Fatalf("query %q: %v %s", expr, err, body)
	}
	var out []map[string]string
	for _, res := range r.Data.Result {
		out = append(out, res.Metric)
	}
	return out
}

// Every shipped alert's expression is evaluated by a real Prometheus on
// what a running pgfence really emits (through the OpenTelemetry
// Prometheus exporter): all empty while healthy, and each non-empty for
// its fault only: a job failing every attempt, the database's connections
// terminated, members that take their share of a consumer group's partitions and of
// the jobs but never lead them.
func TestAlertExpressionsOnRealSeries(t *testing.T) {
	needPrometheus(t)
	db := pgtest.New(t)
	ctx := pgtest.Context(t, 3*time.Minute)
	rules := shippedAlerts(t)

	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		t.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })

	// A TTL long enough that a slow renewal on a loaded machine is not a
	// failure (one would keep PgfenceRenewalsFailing on for 2 minutes).
	client, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, Holder: "app-1", TTL: 5 * time.Second,
		PollInterval: 50 * time.Millisecond, MeterProvider: mp, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	r, err := runner.New(client, runner.Config{RebalanceInterval: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var failing atomic.Bool
	ok := func(context.Context, *runner.Run) error { return nil }
	flaky := func(context.Context, *runner.Run) error {
		if failing.Load() {
			return errors.New("the payment provider is down")
		}
		return nil
	}
	for _, j := range []runner.Job{{Name: "tick", Schedule: "@every 200ms", Run: ok}, {Name: "flaky", Schedule: "@every 200ms", Run: flaky}} {
		if err := r.Register(j); err != nil {
			t.Fatal(err)
		}
	}
	end := func(context.Context, int) (int64, error) { return 5, nil }
	if err := r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 4, Poll: 100 * time.Millisecond, End: end,
		Consume: func(ctx context.Context, p *runner.Partition) error { return p.Wait(ctx) }}); err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	t.Cleanup(func() {
		stop()
		<-done
		_ = client.Close(context.Background())
	})

	prom := startPrometheus(t, l.Addr().String())
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		if resp, err := http.Get("http://" + l.Addr().String() + "/metrics"); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var lines []string
			for _, line := range strings.Split(string(b), "\n") {
				if strings.HasPrefix(line, "pgfence_") {
					lines = append(lines, line)
				}
			}
			t.Logf("the pgfence series exported:\n%s", strings.Join(lines, "\n"))
		}
	})
	firing := func() map[string][]string {
		out := map[string][]string{}
		for _, a := range rules {
			if res := prom.query(a.Expr); len(res) > 0 {
				out[a.Alert] = res
			}
		}
		return out
	}
	onlyFiring := func(what string, want map[string][]string) {
		t.Helper()
		var got map[string][]string
		pgtest.Eventually(t, 60*time.Second, what, func() bool {
			got = firing()
			return fmt.Sprint(got) == fmt.Sprint(want)
		})
		t.Logf("%s: %v", what, got)
	}

	// Healthy: both jobs and the group's 4 partitions led, scraped.
	pgtest.Eventually(t, 60*time.Second, "both jobs led and the series scraped", func() bool {
		return len(prom.query(`pgfence_runner_leader == 1`)) == 2
	})
	onlyFiring("no alert while healthy", map[string][]string{})
	// Every series a rule selects exists (a misspelled name would leave
	// its alert silent for good).
	for _, a := range rules {
		for _, name := range metricName.FindAllString(a.Expr, -1) {
			if len(prom.query("count("+name+")")) == 0 {
				t.Errorf("%s selects %s, which pgfence does not emit", a.Alert, name)
			}
		}
	}
	// Every panel of the shipped dashboard has data from what pgfence emits
	// (the lag and leaderless panels included: the group reports them).
	for _, expr := range dashboardQueries(t) {
		pgtest.Eventually(t, 30*time.Second, "data for the dashboard's "+expr, func() bool { return len(prom.query(expr)) > 0 })
	}

	// A job failing every attempt.
	failing.Store(true)
	var jobFailing map[string][]string
	pgtest.Eventually(t, 60*time.Second, "PgfenceJobFailing for flaky", func() bool {
		jobFailing = firing()
		return len(jobFailing) == 1 && len(jobFailing["PgfenceJobFailing"]) == 1 && strings.Contains(jobFailing["PgfenceJobFailing"][0], "pgfence_job=flaky")
	})
	failing.Store(false)
	onlyFiring("no alert once flaky succeeds again", map[string][]string{})

	// Members that register the group and the jobs and never lead: the
	// partitions and the jobs given to them have no leader.
	instances := pgx.Identifier{db.Schema, "pgfence_instances"}.Sanitize()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+instances+` (id, started_at, heartbeat_at, expires_at, jobs)
		SELECT 'stuck-' || n, now(), now(), now() + interval '1 hour', ARRAY['tick', 'flaky', 'pgfence/group/relay']
		  FROM generate_series(1, 5) n`); err != nil {
		t.Fatal(err)
	}
	var leaderless []string
	pgtest.Eventually(t, 60*time.Second, "the jobs and partitions given to the stuck members to lose their leader", func() bool {
		jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "")
		if err != nil {
			t.Fatal(err)
		}
		leaderless = nil
		for _, j := range jobs {
			if j.Leader == "" {
				leaderless = append(leaderless, j.Job)
			}
		}
		got := firing()
		return len(leaderless) > 0 && len(got["PgfenceJobWithoutLeader"]) == len(leaderless) && len(got["PgfencePartitionWithoutLeader"]) == 1
	})
	stuck := firing()
	t.Logf("with stuck members (jobs without a leader: %v): %v", leaderless, stuck)
	for _, job := range leaderless {
		if !slices.ContainsFunc(stuck["PgfenceJobWithoutLeader"], func(s string) bool { return strings.HasSuffix(s, "pgfence_job="+job) }) {
			t.Errorf("PgfenceJobWithoutLeader does not name %s: %v", job, stuck["PgfenceJobWithoutLeader"])
		}
	}
	if len(stuck) != 2 || !strings.HasSuffix(stuck["PgfencePartitionWithoutLeader"][0], "pgfence_group=relay") {
		t.Errorf("with stuck members, firing %v; want PgfenceJobWithoutLeader and PgfencePartitionWithoutLeader (relay) only", stuck)
	}
	if _, err := db.Pool.Exec(ctx, `DELETE FROM `+instances+` WHERE id LIKE 'stuck-%'`); err != nil {
		t.Fatal(err)
	}
	onlyFiring("no alert once the stuck members are gone", map[string][]string{})

	// The database's connections terminated: renewals fail.
	pgtest.Eventually(t, 60*time.Second, "PgfenceRenewalsFailing", func() bool {
		if _, err := db.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE pid <> pg_backend_pid() AND datname = current_database() AND application_name <> ''
			  AND query NOT LIKE '%pg_terminate_backend%'`); err != nil {
			t.Logf("terminate: %v", err)
		}
		got := firing()
		return len(got["PgfenceRenewalsFailing"]) > 0
	})
	t.Logf("after the connections were terminated: %v", firing())
	// The runner's heartbeat, on its own connection, failed too.
	pgtest.Eventually(t, 60*time.Second, "heartbeat failures counted", func() bool {
		return len(prom.query(`increase(pgfence_runner_heartbeat_failures_total[5m]) > 0`)) > 0
	})
}

// dashboardQueries are the Prometheus expressions of the shipped Grafana
// dashboard's panels.
func dashboardQueries(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("grafana-dashboard.json: %v", err)
	}
	var exprs []string
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			exprs = append(exprs, tg.Expr)
		}
	}
	if len(exprs) == 0 {
		t.Fatal("no queries in grafana-dashboard.json")
	}
	return exprs
}

package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgcluster"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// config is one run of the suite.
type config struct {
	seed     uint64
	duration time.Duration
	workers  int
	fenced   bool
	crashes  int
}

// faults counts the faults that took effect.
type faults struct {
	pauses, kills, proxy, clock, crashes atomic.Int64
}

// crash is one server crash, for the token check across it.
type crash struct{ at, restarted time.Time }

// env is a running suite: cluster, proxies, workers.
type suite struct {
	t       *testing.T
	cfg     config
	cluster *pgcluster.Cluster
	admin   *pgxpool.Pool
	dir     string
	proxies []*faultproxy.Proxy
	procs   []*exec.Cmd
	f       faults
	crashes []crash

	mu     sync.Mutex
	paused map[int]bool
}

func newSuite(t *testing.T, cfg config) *suite {
	t.Helper()
	c, err := pgcluster.New()
	pgtest.NeedTool(t, err, pgcluster.ErrNoServer)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	s := &suite{t: t, cfg: cfg, cluster: c, dir: t.TempDir(), paused: map[int]bool{}}
	ctx := context.Background()
	pcfg, err := pgxpool.ParseConfig(c.URL())
	if err != nil {
		t.Fatal(err)
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = "chaos-admin"
	pcfg.ConnConfig.ConnectTimeout = 2 * time.Second
	s.admin, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.admin.Close)
	for _, schema := range []string{"pgfence", "data"} {
		if _, err := migrations.Up(ctx, s.admin, schema); err != nil {
			t.Fatal(err)
		}
	}
	for _, stmt := range []string{
		"CREATE TABLE data.register (id int PRIMARY KEY, value bigint NOT NULL)",
		"INSERT INTO data.register VALUES (1, 0)",
		"CREATE TABLE data.write_log (value bigint NOT NULL, token bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
		"CREATE TABLE data.charges (customer int NOT NULL, night timestamptz NOT NULL, token bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
		// Every token ever issued, logged in the acquiring transaction: the
		// ground truth for monotonicity, stale writes and unknown outcomes.
		"CREATE TABLE data.acq_log (id bigserial PRIMARY KEY, name text NOT NULL, token bigint NOT NULL, holder text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
		`CREATE FUNCTION data.log_acq() RETURNS trigger LANGUAGE plpgsql AS $$
		 BEGIN INSERT INTO data.acq_log (name, token, holder) VALUES (NEW.name, NEW.token, NEW.holder); RETURN NULL; END $$`,
		"CREATE TRIGGER log_acq_insert AFTER INSERT ON pgfence.pgfence_leases FOR EACH ROW EXECUTE FUNCTION data.log_acq()",
		"CREATE TRIGGER log_acq_update AFTER UPDATE ON pgfence.pgfence_leases FOR EACH ROW WHEN (NEW.token <> OLD.token) EXECUTE FUNCTION data.log_acq()",
	} {
		if _, err := s.admin.Exec(ctx, stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for i := range cfg.workers {
		p, err := faultproxy.New(c.Addr())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Close() })
		s.proxies = append(s.proxies, p)
		cmd := exec.Command(self, "-test.run=^$")
		fenced := "0"
		if cfg.fenced {
			fenced = "1"
		}
		cmd.Env = append(os.Environ(), roleEnv+"=worker", fmt.Sprintf("CHAOS_ID=%d", i+1), "CHAOS_FENCED="+fenced,
			fmt.Sprintf("CHAOS_SEED=%d", cfg.seed), "CHAOS_OUT="+s.historyFile(i),
			"CHAOS_URL=postgres://postgres@"+p.Addr()+"/postgres?sslmode=disable")
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		s.procs = append(s.procs, cmd)
		t.Cleanup(func() {
			_ = cmd.Process.Signal(syscall.SIGCONT)
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
	}
	return s
}

func (s *suite) historyFile(i int) string { return filepath.Join(s.dir, fmt.Sprintf("w%d.jsonl", i+1)) }

// run injects faults for the configured duration, then stops the workers.
func (s *suite) run() {
	end := time.Now().Add(s.cfg.duration)
	var wg sync.WaitGroup
	inject := func(name string, offset uint64, fn func(rng *rand.Rand)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(s.cfg.seed, offset))
			for time.Now().Before(end) {
				fn(rng)
			}
		}()
	}
	pause := func(rng *rand.Rand) {
		w := rng.IntN(s.cfg.workers)
		d := leaseTTL + time.Duration(rng.IntN(int(leaseTTL)))
		s.mu.Lock()
		busy := s.paused[w]
		s.paused[w] = true
		s.mu.Unlock()
		if !busy {
			if s.procs[w].Process.Signal(syscall.SIGSTOP) == nil {
				s.f.pauses.Add(1)
			}
			time.Sleep(d) // longer than the TTL
			_ = s.procs[w].Process.Signal(syscall.SIGCONT)
			s.mu.Lock()
			delete(s.paused, w)
			s.mu.Unlock()
		}
		time.Sleep(time.Duration(50+rng.IntN(200)) * time.Millisecond)
	}
	inject("pause-a", 1, pause)
	inject("pause-b", 2, pause)
	inject("kill", 3, func(rng *rand.Rand) {
		time.Sleep(time.Duration(200+rng.IntN(400)) * time.Millisecond)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		var n int
		// One random backend of a random worker, or all of them.
		err := s.admin.QueryRow(ctx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE application_name = $1 ORDER BY random() LIMIT $2) k`, fmt.Sprintf("chaos-w%d", 1+rng.IntN(s.cfg.workers)), 1+rng.IntN(3)*10).Scan(&n)
		if err == nil && n > 0 {
			s.f.kills.Add(1)
		}
	})
	inject("proxy", 4, func(rng *rand.Rand) {
		time.Sleep(time.Duration(100+rng.IntN(300)) * time.Millisecond)
		p := s.proxies[rng.IntN(len(s.proxies))]
		switch rng.IntN(3) {
		case 0:
			p.Set(faultproxy.Blackhole)
			time.Sleep(time.Duration(200+rng.IntN(600)) * time.Millisecond)
		case 1:
			p.Set(faultproxy.Reset)
			time.Sleep(time.Duration(50+rng.IntN(150)) * time.Millisecond)
		case 2:
			p.SetDelay(time.Duration(20+rng.IntN(60)) * time.Millisecond)
			time.Sleep(500 * time.Millisecond)
			p.SetDelay(0)
		}
		p.Set(faultproxy.Pass)
		s.f.proxy.Add(1)
	})
	inject("clock", 5, func(rng *rand.Rand) {
		time.Sleep(time.Duration(200+rng.IntN(400)) * time.Millisecond)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		name := register
		if rng.IntN(2) == 0 {
			name = "pgfence/job/" + chargeJob
		}
		// Mostly expire the holder's lease under it; sometimes extend
		// its session past what the holder itself trusts.
		expire := expiry.SQL("pgfence")
		if rng.IntN(5) == 0 {
			expire = "UPDATE pgfence.pgfence_sessions SET expires_at = expires_at + interval '500 milliseconds' " +
				"WHERE id = (SELECT session FROM pgfence.pgfence_leases WHERE name = $1)"
		}
		tag, err := s.admin.Exec(ctx, expire, name)
		if err == nil && tag.RowsAffected() > 0 {
			s.f.clock.Add(1)
		}
	})
	if s.cfg.crashes > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 1; i <= s.cfg.crashes; i++ {
				at := time.Duration(i) * s.cfg.duration / time.Duration(s.cfg.crashes+1)
				time.Sleep(time.Until(end.Add(-s.cfg.duration).Add(at)))
				c := crash{at: time.Now()}
				if err := s.cluster.Crash(); err != nil {
					s.t.Errorf("crash: %v", err)
					return
				}
				time.Sleep(300 * time.Millisecond)
				if err := s.cluster.Start(); err != nil {
					s.t.Errorf("restart after crash: %v", err)
					return
				}
				c.restarted = time.Now()
				s.mu.Lock()
				s.crashes = append(s.crashes, c)
				s.mu.Unlock()
				s.f.crashes.Add(1)
			}
		}()
	}
	wg.Wait()

	// Stop: everyone running, the network healthy, then SIGTERM; a worker
	// finishes and records its current operation before it exits.
	for i, p := range s.procs {
		_ = p.Process.Signal(syscall.SIGCONT)
		s.proxies[i].Set(faultproxy.Pass)
		s.proxies[i].SetDelay(0)
	}
	for _, p := range s.procs {
		_ = p.Process.Signal(syscall.SIGTERM)
	}
	for _, p := range s.procs {
		done := make(chan struct{})
		go func() { _ = p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			s.t.Errorf("worker %d did not stop after SIGTERM", p.Process.Pid)
			_ = p.Process.Kill()
			<-done
		}
	}
	// Whatever a worker left open on the server has ended after opBound.
	time.Sleep(opBound)
}

// histories loads every worker's records.
func (s *suite) histories() []record {
	var all []record
	for i := range s.cfg.workers {
		f, err := os.Open(s.historyFile(i))
		if err != nil {
			s.t.Fatalf("worker %d wrote no history: %v", i+1, err)
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			var r record
			if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
				s.t.Fatalf("history of worker %d: %v", i+1, err)
			}
			all = append(all, r)
		}
		_ = f.Close()
	}
	return all
}

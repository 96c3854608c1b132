package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// Two copies: one leads; SIGTERM makes it release at once and the other
// takes over.
func TestLeaderHandsOverOnSIGTERM(t *testing.T) {
	bin := pgtest.Build(t, ".")
	schema := pgtest.Schema(t, "leader")
	type proc struct {
		cmd   *exec.Cmd
		lines chan string
	}
	startCopy := func() *proc {
		cmd := exec.Command(bin, "-schema", schema)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.URL(t))
		out, _ := cmd.StdoutPipe()
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		p := &proc{cmd, make(chan string, 100)}
		go func() {
			s := bufio.NewScanner(out)
			for s.Scan() {
				p.lines <- s.Text()
			}
			close(p.lines)
		}()
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return p
	}
	waitLine := func(p *proc, substr string, d time.Duration) bool {
		timeout := time.After(d)
		for {
			select {
			case l, ok := <-p.lines:
				if !ok {
					return false
				}
				if strings.Contains(l, substr) {
					return true
				}
			case <-timeout:
				return false
			}
		}
	}
	a := startCopy()
	if !waitLine(a, "leading with token 1", 20*time.Second) {
		t.Fatal("first copy never led")
	}
	b := startCopy()
	if !waitLine(b, "campaigning", 20*time.Second) {
		t.Fatal("second copy did not start")
	}
	// The second copy waits once its poller has marked the lease row
	// (waiters_until): its listener listens, and the release notifies it.
	pool := pgtest.NewPool(t, pgtest.UniqueName("leader-test"))
	pgtest.Eventually(t, 20*time.Second, "the second copy to wait for the lease", func() bool {
		var n int
		_ = pool.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{schema, "pgfence_leases"}.Sanitize()+
			" WHERE name = 'example-leader' AND waiters_until IS NOT NULL").Scan(&n)
		return n == 1
	})
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	if !waitLine(a, "stepped down; lease released", 5*time.Second) {
		t.Fatal("leader did not step down on SIGTERM")
	}
	if err := a.cmd.Wait(); err != nil {
		t.Fatalf("leader exit: %v", err)
	}
	if !waitLine(b, "leading with token 2", 2*time.Second) {
		t.Fatal("second copy did not take over within 2s")
	}
}

// Without DATABASE_URL the example uses the libpq variables; with none that
// answers it says how to provide a database and exits 1.
func TestLeaderFindsItsDatabase(t *testing.T) {
	bin := pgtest.Build(t, ".")
	cfg, err := pgx.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	base := []string{"PGUSER=" + cfg.User, "PGDATABASE=" + cfg.Database, "PGHOST=" + cfg.Host, "PGSSLMODE=disable"}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") && !strings.HasPrefix(kv, "PG") {
			base = append(base, kv)
		}
	}
	// -for bounds the whole run, migrations included: long enough for them
	// on a loaded machine (500 ms was not).
	cmd := exec.Command(bin, "-schema", pgtest.Schema(t, "leader"), "-for", "5s")
	cmd.Env = append(base, fmt.Sprintf("PGPORT=%d", cfg.Port))
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "database: libpq defaults") || !strings.Contains(string(out), "leading with token") {
		t.Fatalf("with libpq variables: %v\n%s", err, out)
	}
	cmd = exec.Command(bin, "-for", "500ms")
	cmd.Env = append(base, "PGPORT=1", "PGCONNECT_TIMEOUT=2")
	out, _ = cmd.CombinedOutput()
	if cmd.ProcessState.ExitCode() != 1 || !strings.Contains(string(out), "no PostgreSQL server found") || !strings.Contains(string(out), "DATABASE_URL=") {
		t.Fatalf("with nothing to connect to: exit %d\n%s", cmd.ProcessState.ExitCode(), out)
	}
}

// The example is copyable: main.go alone, in a module of its own
// that requires pgfence (replaced by this checkout), builds. (Formerly it
// imported pgfence/internal/devdb: "use of internal package not allowed".)
func TestCopiesIntoItsOwnModule(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	goMod := "module example.com/myservice\n\ngo 1.26.0\n\nrequire github.com/pgfence/pgfence v0.0.0\n\n" +
		"replace github.com/pgfence/pgfence => " + root + "\n"
	for name, data := range map[string][]byte{"main.go": src, "go.mod": []byte(goMod), "go.sum": sum} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, args := range [][]string{{"mod", "tidy"}, {"build", "-o", filepath.Join(dir, "leader"), "."}} {
		cmd := exec.Command("go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s in a module of its own: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The quick start runs and charges three customers under one token.
func TestQuickStart(t *testing.T) {
	db := pgtest.New(t)
	pool := pgtest.NewPool(t, "quickstart", func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{db.Schema}.Sanitize() // its charges table
	})
	var out strings.Builder
	if err := run(pgtest.Context(t, time.Minute), pool, db.Schema, &out); err != nil {
		t.Fatal(err)
	}
	if strings.Count(out.String(), "charged") != 3 {
		t.Fatalf("output:\n%s", out.String())
	}
}

// The quick start, as README runs it (its own database, no schema named),
// charges each customer once however many copies run, one after the other
// or at the same time; and the CLI then finds pgfence's tables with no
// --schema.
func TestQuickStartChargesEachCustomerOnce(t *testing.T) {
	bin := pgtest.Build(t, ".")
	cli := pgtest.Build(t, "../../cmd/pgfence")
	charges := func(url string) (n, customers int) {
		t.Helper()
		conn, err := pgx.Connect(pgtest.Context(t, time.Minute), url)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		if err := conn.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT customer) FROM charges`).Scan(&n, &customers); err != nil {
			t.Fatal(err)
		}
		return n, customers
	}
	start := func(url string) (*exec.Cmd, *bytes.Buffer) {
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+url)
		out := &bytes.Buffer{}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd, out
	}
	wait := func(cmd *exec.Cmd, out *bytes.Buffer) {
		t.Helper()
		if err := cmd.Wait(); err != nil {
			t.Fatalf("quickstart: %v\n%s", err, out)
		}
	}

	t.Run("one after the other", func(t *testing.T) {
		url := pgtest.Database(t)
		for range 2 {
			cmd, out := start(url)
			wait(cmd, out)
			// It says which database it used.
			cc, err := pgx.ParseConfig(url)
			if err != nil {
				t.Fatal(err)
			}
			if want := fmt.Sprintf("database %q as user %q", cc.Database, cc.User); !strings.HasPrefix(out.String(), want) {
				t.Fatalf("the output does not start with %q:\n%s", want, out)
			}
		}
		if n, c := charges(url); n != 3 || c != 3 {
			t.Fatalf("two runs left %d charges of %d customers; want 3 of 3", n, c)
		}
		for _, args := range [][]string{{"leases"}, {"jobs"}, {"migrate", "status"}} {
			cmd := exec.Command(cli, args...)
			cmd.Env = append(os.Environ(), "DATABASE_URL="+url, "PGFENCE_SCHEMA=")
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("pgfence %s after the quick start: %v\n%s", strings.Join(args, " "), err, out)
			}
			if args[0] == "leases" && !strings.Contains(string(out), "nightly-billing") {
				t.Fatalf("pgfence leases does not list the quick start's lease:\n%s", out)
			}
		}
	})
	t.Run("at the same time", func(t *testing.T) {
		url := pgtest.Database(t)
		a, aOut := start(url)
		b, bOut := start(url)
		wait(a, aOut)
		wait(b, bOut)
		if n, c := charges(url); n != 3 || c != 3 {
			t.Fatalf("two copies at once left %d charges of %d customers; want 3 of 3\n%s\n%s", n, c, aOut, bOut)
		}
	})
}

// Without DATABASE_URL the quick start does not guess a database (libpq's
// defaults once migrated another user's database): it starts a throwaway
// private server, says so, charges the three customers there, and removes
// the server when it ends: its port no longer answers and its files are
// gone.
func TestQuickStartWithoutDatabaseURLUsesAThrowawayServer(t *testing.T) {
	bin := pgtest.Build(t, ".")
	tmp := t.TempDir()
	for _, d := range []string{filepath.Dir(tmp), tmp} { // as root, the server runs as nobody
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(bin)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") && !strings.HasPrefix(kv, "TMPDIR=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "TMPDIR="+tmp)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("without DATABASE_URL: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "no DATABASE_URL: using a") || !strings.Contains(string(out), "removed at exit") {
		t.Fatalf("the quick start did not say it used a throwaway server:\n%s", out)
	}
	for _, c := range []string{"alice", "bob", "carol"} {
		if !strings.Contains(string(out), "charged "+c+" under token 1") {
			t.Fatalf("%s not charged under token 1:\n%s", c, out)
		}
	}
	m := regexp.MustCompile(`at (127\.0\.0\.1:\d+)`).FindStringSubmatch(string(out))
	if m == nil {
		t.Fatalf("no server address in:\n%s", out)
	}
	if c, err := net.DialTimeout("tcp", m[1], 5*time.Second); err == nil {
		_ = c.Close()
		t.Fatalf("the throwaway server at %s still answers after the quick start ended", m[1])
	}
	left, err := os.ReadDir(tmp)
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 0 {
		t.Fatalf("the throwaway server left %d entries in TMPDIR (%s), first %s", len(left), tmp, left[0].Name())
	}
}

// Every Go block in README.md is code that compiles: it stands,
// line for line (indentation aside), in a Go file of this repository that
// the build or the tests compile. So README's code cannot rot.
func TestREADMEGoBlocksAreCompiledCode(t *testing.T) {
	root := filepath.Join("..", "..")
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	var blocks [][]string
	var cur []string
	in := false
	sc := bufio.NewScanner(strings.NewReader(string(readme)))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case !in && strings.TrimSpace(line) == "```go":
			in, cur = true, nil
		case in && strings.TrimSpace(line) == "```":
			in = false
			blocks = append(blocks, cur)
		case in:
			cur = append(cur, line)
		}
	}
	if len(blocks) == 0 {
		t.Fatal("README.md has no Go block")
	}
	var files [][]string
	err = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") || !strings.HasSuffix(p, ".go") {
			return err
		}
		b, err := os.ReadFile(p)
		files = append(files, strings.Split(string(b), "\n"))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	norm := func(lines []string) []string {
		var out []string
		for _, l := range lines {
			if l = strings.TrimSpace(l); l != "" {
				out = append(out, l)
			}
		}
		return out
	}
	contains := func(file, block []string) bool {
		f, b := norm(file), norm(block)
		for i := 0; i+len(b) <= len(f); i++ {
			match := true
			for j := range b {
				if f[i+j] != b[j] {
					match = false
					break
				}
			}
			if match {
				return true
			}
		}
		return false
	}
	for i, b := range blocks {
		found := false
		for _, f := range files {
			if contains(f, b) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("README Go block %d is not code of this repository (copy it from, or into, a compiled file):\n%s", i+1, strings.Join(b, "\n"))
		}
	}
}

// Every command README gives runs as written: a `go run` of the CLI or of
// the leader example names its database (DATABASE_URL on the line, or
// exported earlier in the same block; the other examples start a throwaway
// server without it), and no argument is a synopsis placeholder ([--flag],
// a|b) that a shell would pass on literally.
func TestREADMECommandsRunAsWritten(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	exported, inFence := false, false
	checked := 0
	for i, line := range strings.Split(string(readme), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
			continue
		}
		if inFence || !strings.HasPrefix(line, "    ") {
			if strings.TrimSpace(line) != "" {
				exported = false // a block ends at the next paragraph
			}
			continue
		}
		cmd, _, _ := strings.Cut(strings.TrimSpace(line), " #") // a trailing comment
		if strings.HasPrefix(cmd, "export DATABASE_URL=") {
			exported = true
		}
		if !strings.Contains(cmd, "go run ./examples/") && !strings.Contains(cmd, "go run ./cmd/pgfence") {
			continue
		}
		checked++
		// The examples start a throwaway server without DATABASE_URL
		// (but leader, which uses libpq's defaults); the CLI does not.
		needsURL := strings.Contains(cmd, "go run ./cmd/pgfence") || strings.Contains(cmd, "go run ./examples/leader")
		if needsURL && !exported && !strings.Contains(cmd, "DATABASE_URL=") {
			t.Errorf("README.md:%d: %q runs on libpq's defaults: set DATABASE_URL on the line or export it above", i+1, cmd)
		}
		if strings.ContainsAny(cmd, "[]|") {
			t.Errorf("README.md:%d: %q has a synopsis placeholder, not a command", i+1, cmd)
		}
	}
	if checked < 3 {
		t.Fatalf("found %d commands in README.md; the check is not reading it", checked)
	}
}

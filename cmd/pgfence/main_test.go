package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// cli runs the built pgfence binary against the test database in its own schema.
type cli struct {
	t      *testing.T
	bin    string
	schema string
}

func newCLI(t *testing.T) *cli {
	t.Helper()
	c := &cli{t: t, bin: pgtest.Build(t, "."), schema: pgtest.Schema(t, "cli")}
	out, code := c.run("", "migrate", "up")
	if code != 0 {
		t.Fatalf("migrate up: %d %s", code, out)
	}
	// A migration names where it went.
	if cc, err := pgx.ParseConfig(pgtest.URL(t)); err != nil || !strings.Contains(out, fmt.Sprintf("in database %q as user %q", cc.Database, cc.User)) {
		t.Fatalf("migrate up does not name its database (%v):\n%s", err, out)
	}
	return c
}

func (c *cli) cmd(stdin string, args ...string) *exec.Cmd {
	cmd := exec.Command(c.bin, append([]string{"--schema", c.schema}, args...)...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.URL(c.t))
	cmd.Stdin = strings.NewReader(stdin)
	return cmd
}

// run returns combined output and the exit code.
func (c *cli) run(stdin string, args ...string) (string, int) {
	c.t.Helper()
	cmd := c.cmd(stdin, args...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		if _, ok := err.(*exec.ExitError); !ok {
			c.t.Fatalf("pgfence %v: %v", args, err)
		}
	}
	return string(out), cmd.ProcessState.ExitCode()
}

// Two concurrent invocations run the child one at a time, each
// with its own token.
func TestRunOneAtATime(t *testing.T) {
	c := newCLI(t)
	log := filepath.Join(t.TempDir(), "log")
	script := `echo "start $PGFENCE_TOKEN" >> ` + log + `; sleep 0.5; echo "end $PGFENCE_TOKEN" >> ` + log
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if out, code := c.run("", "run", "--wait", "--lease", "cron-backup", "--", "sh", "-c", script); code != 0 {
				t.Errorf("run: %d %s", code, out)
			}
		}()
	}
	wg.Wait()
	b, _ := os.ReadFile(log)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) != 4 {
		t.Fatalf("log = %q", lines)
	}
	for i := 0; i < 4; i += 2 {
		tok := strings.TrimPrefix(lines[i], "start ")
		if !strings.HasPrefix(lines[i], "start ") || lines[i+1] != "end "+tok {
			t.Fatalf("runs overlapped: %q", lines)
		}
	}
	if lines[0] == lines[2] {
		t.Fatalf("both runs had the same token: %q", lines)
	}
}

// The child sees its token and lease; exit codes pass through;
// a held lease without --wait exits 75.
func TestRunEnvExitCodesAndHeld(t *testing.T) {
	c := newCLI(t)
	out, code := c.run("", "run", "--lease", "env", "--", "sh", "-c", `test "$PGFENCE_LEASE" = env && echo "token=$PGFENCE_TOKEN"; exit 7`)
	if code != 7 || !regexp.MustCompile(`token=[1-9][0-9]*`).MatchString(out) {
		t.Fatalf("exit %d, output %q", code, out)
	}
	if _, code := c.run("", "run", "--lease", "env", "--", "sh", "-c", "kill -TERM $$"); code != 128+15 {
		t.Fatalf("signaled child: exit %d, want 143", code)
	}
	holder := c.cmd("", "run", "--lease", "busy", "--", "sleep", "3")
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer holder.Wait()
	waitHeld(t, c, "busy")
	out, code = c.run("", "run", "--lease", "busy", "--", "true")
	if code != 75 || !strings.Contains(out, `lease "busy" is held by`) {
		t.Fatalf("held: exit %d, %q", code, out)
	}
}

func waitHeld(t *testing.T, c *cli, name string) {
	t.Helper()
	pgtest.Eventually(t, 10*time.Second, "lease "+name+" to be held", func() bool {
		out, _ := c.run("", "leases", "--json")
		var ls []map[string]any
		_ = json.Unmarshal([]byte(out), &ls)
		for _, l := range ls {
			if l["name"] == name && l["held"] == true {
				return true
			}
		}
		return false
	})
}

// Leases --json, release with and without confirmation;
// a force-released holder's command is terminated and pgfence exits 76.
func TestLeasesReleaseAndLoss(t *testing.T) {
	c := newCLI(t)
	var stderr bytes.Buffer
	holder := c.cmd("", "run", "--ttl", "900ms", "--grace", "2s", "--lease", "nightly", "--", "sleep", "30")
	holder.Stderr = &stderr
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, c, "nightly")

	out, code := c.run("", "leases", "--json")
	var leases []map[string]any
	if err := json.Unmarshal([]byte(out), &leases); err != nil || code != 0 || len(leases) != 1 {
		t.Fatalf("leases --json: %d %q %v", code, out, err)
	}
	var keys []string
	for k := range leases[0] {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	if got := strings.Join(keys, ","); got != "acquired_at,expires_at,expires_in_seconds,held,held_for_seconds,holder,name,renewed_at,token" {
		t.Fatalf("JSON keys = %s", got)
	}
	// Tokens are decimal strings in every JSON output (exact for readers
	// that hold numbers as doubles), as in pgfence jobs --json.
	if l := leases[0]; l["name"] != "nightly" || l["token"] != "1" || l["holder"] == "" || l["expires_in_seconds"].(float64) <= 0 {
		t.Fatalf("lease = %v", l)
	}
	if out, _ := c.run("", "leases"); !strings.Contains(out, "NAME") || !strings.Contains(out, "nightly") {
		t.Fatalf("leases table: %q", out)
	}
	if out, code := c.run("", "release", "no-such-lease", "--yes"); code != 3 || !strings.Contains(out, "no lease named") {
		t.Fatalf("release unknown: %d %q", code, out)
	}
	if out, code := c.run("n\n", "release", "nightly"); code != 1 || !strings.Contains(out, "not released") {
		t.Fatalf("declined release: %d %q", code, out)
	}
	start := time.Now()
	if out, code := c.run("y\n", "release", "nightly"); code != 0 || !strings.Contains(out, "released") {
		t.Fatalf("confirmed release: %d %q", code, out)
	}
	err := holder.Wait()
	if code := holder.ProcessState.ExitCode(); code != 76 {
		t.Fatalf("holder exit %d (%v), want 76; stderr %q", code, err, stderr.String())
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("command terminated %v after the release", d)
	}
	if !strings.Contains(stderr.String(), "lease lost") {
		t.Fatalf("stderr = %q", stderr.String())
	}
	if out, code := c.run("", "run", "--lease", "nightly", "--", "sh", "-c", "echo $PGFENCE_TOKEN"); code != 0 || strings.TrimSpace(out) != "2" {
		t.Fatalf("next holder: %d %q, want token 2", code, out)
	}
	if out, code := c.run("", "jobs", "--json"); code != 0 || strings.TrimSpace(out) != "[]" {
		t.Fatalf("jobs on an empty ledger: %d %q", code, out)
	}
}

// Bad input gets a message on stderr and a documented code.
func TestBadInput(t *testing.T) {
	c := newCLI(t)
	cases := []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"run", "--lease", "x", "--"}, 2, "missing command after --"},
		{[]string{"run", "--", "true"}, 2, "--lease is required"},
		{[]string{"run", "--lease", "x", "--ttl", "soon", "--", "true"}, 2, "invalid value"},
		{[]string{"run", "--lease", "x", "--ttl", "-1s", "--", "true"}, 2, "--ttl must be positive"},
		{[]string{"run", "--lease", "x", "--ttl", "1ms", "--", "true"}, 2, "TTL: must be at least"},
		{[]string{"release"}, 2, "exactly one lease name"},
		{[]string{"frobnicate"}, 2, "unknown command"},
		{[]string{"migrate", "sideways"}, 2, "up or status"},
		{[]string{"--database-url", "postgres://postgres@127.0.0.1:1/none?connect_timeout=2", "leases"}, 1, "cannot reach database \"none\" as user \"postgres\""},
	}
	for _, tc := range cases {
		cmd := c.cmd("", tc.args...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		_ = cmd.Run()
		if code := cmd.ProcessState.ExitCode(); code != tc.code || !strings.Contains(stderr.String(), tc.msg) {
			t.Errorf("%v: exit %d stderr %q; want %d and %q", tc.args, code, stderr.String(), tc.code, tc.msg)
		}
	}
}

// Names and holders are printed with their control characters
// escaped: a lease name with a newline cannot forge a line in the table.
// Release waits behind an open guarded transaction only for
// --timeout, and names the session that holds it up.
// Migrate status on a mistyped schema says so and creates nothing.
func TestOperatorSafety(t *testing.T) {
	c := newCLI(t)
	ctx := pgtest.Context(t, time.Minute)
	pool := pgtest.NewPool(t, "cli-safety")
	lc, err := lock.New(pool, lock.Config{Schema: c.schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close(ctx)
	forged := "real\nforged-lease  evil  999  1h  1h"
	l, err := lc.TryAcquire(ctx, forged)
	if err != nil {
		t.Fatal(err)
	}
	out, code := c.run("", "leases")
	if code != 0 || strings.Count(out, "\n") != 2 || !strings.Contains(out, `"real\nforged-lease`) {
		t.Fatalf("leases with a control character in a name: %d\n%s", code, out)
	}

	app := pgtest.UniqueName("guard")
	gpool := pgtest.NewPool(t, app)
	tx, err := gpool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := l.Guard().Check(ctx, tx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	out, code = c.run("", "release", "--yes", "--timeout", "300ms", forged)
	if code != 1 || !strings.Contains(out, app) || !strings.Contains(out, "not released") || time.Since(start) > 10*time.Second {
		t.Fatalf("release behind a guarded transaction: %d after %v\n%s", code, time.Since(start), out)
	}
	_ = tx.Rollback(ctx)
	if out, code := c.run("", "release", "--yes", forged); code != 0 || strings.Count(out, "\n") != 1 {
		t.Fatalf("release after the transaction ended: %d\n%s", code, out)
	}

	// A holder frozen in a guarded transaction while its lease expires:
	// the release, waiting on the lease row, ends the frozen session once
	// the lease has expired, and prints which. The holder's client cannot
	// renew (its session row is locked), so its lease expires 2 s on.
	hc, err := lock.New(pool, lock.Config{Schema: c.schema, TTL: 2 * time.Second, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close(context.Background())
	frozen, err := hc.TryAcquire(ctx, "frozen")
	if err != nil {
		t.Fatal(err)
	}
	stx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer stx.Rollback(context.Background())
	if _, err := stx.Exec(ctx, "SELECT 1 FROM "+pgx.Identifier{c.schema, "pgfence_sessions"}.Sanitize()+
		" WHERE holder = $1 FOR UPDATE", hc.Config().Holder); err != nil {
		t.Fatal(err)
	}
	ftx, err := gpool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer ftx.Rollback(context.Background())
	if err := frozen.Guard().Check(ctx, ftx); err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := ftx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	out, code = c.run("", "release", "--yes", "--timeout", "30s", "frozen")
	if code != 0 || !strings.Contains(out, fmt.Sprintf("ended session %d (%s", pid, app)) {
		t.Fatalf("release behind a holder frozen in a guarded transaction: %d\n%s", code, out)
	}

	typo := c.schema + "_typo"
	out, code = c.run("", "--schema", typo, "migrate", "status")
	if code != 0 || !strings.Contains(out, "no such schema") {
		t.Fatalf("migrate status on a missing schema: %d\n%s", code, out)
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, typo).Scan(&exists); err != nil || exists {
		t.Fatalf("migrate status created schema %q (%v)", typo, err)
	}
}

// The CLI and the library agree on the schema: PGFENCE_SCHEMA
// chooses it, and a missing table says which schema was searched and how
// to choose another.
func TestSchemaFromEnvironment(t *testing.T) {
	c := newCLI(t)
	run := func(schema string, args ...string) (string, int) {
		cmd := exec.Command(c.bin, args...)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.URL(t), "PGFENCE_SCHEMA="+schema)
		out, _ := cmd.CombinedOutput()
		return string(out), cmd.ProcessState.ExitCode()
	}
	if out, code := run(c.schema, "leases"); code != 0 || !strings.Contains(out, "NAME") {
		t.Fatalf("leases with PGFENCE_SCHEMA=%s: %d\n%s", c.schema, code, out)
	}
	out, code := run(c.schema+"_missing", "leases")
	if code != 1 || !strings.Contains(out, `looked in schema "`+c.schema+`_missing"`) || !strings.Contains(out, "PGFENCE_SCHEMA") {
		t.Fatalf("leases on a schema without pgfence's tables: %d\n%s", code, out)
	}
}

// The version command prints the module version and, for a binary built from
// a git checkout, the commit it was built from.
func TestVersionNamesTheCommit(t *testing.T) {
	head, gitErr := exec.Command("git", "rev-parse", "HEAD").Output()
	bin := pgtest.Build(t, ".")
	if gitErr == nil { // stamp the commit even where GOFLAGS has -buildvcs=false
		bin = filepath.Join(t.TempDir(), "pgfence-vcs")
		if out, err := exec.Command("go", "build", "-buildvcs=true", "-o", bin, ".").CombinedOutput(); err != nil {
			t.Fatalf("go build -buildvcs=true: %v\n%s", err, out)
		}
	}
	out, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("pgfence version: %v\n%s", err, out)
	}
	if !regexp.MustCompile(`^pgfence \S+ go1\.\d+`).Match(out) {
		t.Fatalf("pgfence version printed %q; want \"pgfence VERSION goX.Y...\"", out)
	}
	if gitErr != nil {
		t.Logf("not a git checkout (%v): no commit to compare", gitErr)
		return
	}
	if want := "commit " + strings.TrimSpace(string(head)); !strings.Contains(string(out), want) {
		t.Fatalf("pgfence version printed %q; want it to contain %q", out, want)
	}
}

// Mistakes a newcomer makes get a message that says what happened and what
// to do, and the database errors name the database and user connected as.
func TestMessagesSayWhatToDo(t *testing.T) {
	c := newCLI(t)
	empty := pgtest.Database(t) // no pgfence tables
	cases := []struct {
		name string
		env  []string
		args []string
		code int
		want []string
		not  []string
	}{
		{"migrate down", nil, []string{"migrate", "down"}, 2,
			[]string{`"down"`, "up or status"}, []string{"takes one argument"}},
		{"not migrated", []string{"DATABASE_URL=" + empty}, []string{"leases"}, 1,
			[]string{`schema "pgfence"`, "migrate up", `database "` + empty[strings.LastIndex(empty, "/")+1:strings.Index(empty, "?")] + `"`, `user "postgres"`}, nil},
		{"no database named", []string{"DATABASE_URL=", "PGHOST=", "PGHOSTADDR=", "PGDATABASE=", "PGSERVICE="}, []string{"migrate", "up"}, 2,
			[]string{"DATABASE_URL", "--database-url", "does not guess"}, []string{"version"}},
		{"mistyped scheme", nil, []string{"--database-url", "postgress://postgres@127.0.0.1:5432/test", "leases"}, 2,
			[]string{`"postgress"`, "postgres://"}, []string{"failed to parse"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cmd := c.cmd("", tc.args...)
			if tc.env != nil {
				cmd = exec.Command(c.bin, tc.args...)
				cmd.Env = append(os.Environ(), append([]string{"PGFENCE_SCHEMA="}, tc.env...)...)
			}
			out, _ := cmd.CombinedOutput()
			if code := cmd.ProcessState.ExitCode(); code != tc.code {
				t.Errorf("exit %d, want %d\n%s", code, tc.code, out)
			}
			for _, w := range tc.want {
				if !strings.Contains(string(out), w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			for _, n := range tc.not {
				if strings.Contains(string(out), n) {
					t.Errorf("output has %q:\n%s", n, out)
				}
			}
		})
	}

	t.Run("connection refused once", func(t *testing.T) {
		out, code := c.run("", "--database-url", "postgres://postgres@127.0.0.1:1/none?connect_timeout=2", "leases")
		if code != 1 || strings.Count(out, "connection refused") != 1 {
			t.Fatalf("exit %d; want 1 and one \"connection refused\":\n%s", code, out)
		}
	})
	t.Run("release of a free lease", func(t *testing.T) {
		if out, code := c.run("", "run", "--lease", "free-one", "--", "true"); code != 0 {
			t.Fatalf("run: %d %s", code, out)
		}
		out, code := c.run("", "release", "free-one")
		if code != 0 || !strings.Contains(out, "not held") || strings.Contains(out, "[y/N]") || strings.Contains(out, "nobody") {
			t.Fatalf("release of a free lease: exit %d; want 0, \"not held\" and no confirmation:\n%s", code, out)
		}
	})
	t.Run("jobs json tokens", func(t *testing.T) {
		pool := pgtest.NewPool(t, "cli-jobs-json")
		ctx := pgtest.Context(t, time.Minute)
		if _, err := pool.Exec(ctx, `INSERT INTO `+pgx.Identifier{c.schema, "pgfence_runs"}.Sanitize()+
			` (job, shard, kind, slot, attempt, token, status, holder, started_at) VALUES ('j', 0, 'scheduled', now(), 1, 9007199254740993, 'running', 'h', now())`); err != nil {
			t.Fatal(err)
		}
		out, code := c.run("", "jobs", "--json")
		if code != 0 || !strings.Contains(out, `"token": "9007199254740993"`) {
			t.Fatalf("jobs --json: %d\n%s", code, out)
		}
	})
}

// grant app gives a role what an application needs, so that it can list and
// take leases; before it, the role's error names that grant.
func TestGrantApp(t *testing.T) {
	c := newCLI(t)
	ctx := pgtest.Context(t, time.Minute)
	admin := pgtest.NewPool(t, "cli-grant")
	role := "pgfence_cli_" + strings.ToLower(pgtest.UniqueName("r")[2:])
	if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role) })
	as := func(args ...string) (string, int) {
		cmd := exec.Command(c.bin, append([]string{"--schema", c.schema}, args...)...)
		u, err := url.Parse(pgtest.URL(t))
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.User(role)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+u.String())
		out, _ := cmd.CombinedOutput()
		return string(out), cmd.ProcessState.ExitCode()
	}
	if out, code := as("leases"); code != 1 || !strings.Contains(out, "grant app "+role) {
		t.Fatalf("leases without grants: %d; want 1 and the grant to run:\n%s", code, out)
	}
	if out, code := c.run("", "grant", "app", role, "--print"); code != 0 || !strings.Contains(out, "GRANT USAGE ON SCHEMA") {
		t.Fatalf("grant --print: %d\n%s", code, out)
	}
	if out, code := as("leases"); code != 1 {
		t.Fatalf("grant --print granted something: leases %d\n%s", code, out)
	}
	if out, code := c.run("", "grant", "app", role); code != 0 {
		t.Fatalf("grant app: %d\n%s", code, out)
	}
	for _, args := range [][]string{{"leases"}, {"run", "--lease", "granted", "--", "true"}, {"migrate", "status"}, {"jobs"}} {
		if out, code := as(args...); code != 0 {
			t.Fatalf("%v with the app grants: %d\n%s", args, code, out)
		}
	}
	if out, code := c.run("", "grant", "admin", role); code != 2 || !strings.Contains(out, "app") {
		t.Fatalf("grant admin: %d\n%s", code, out)
	}
	if out, code := c.run("", "grant", "app", role+"_missing"); code != 1 || !strings.Contains(out, "CREATE ROLE") {
		t.Fatalf("grant to a missing role: %d\n%s", code, out)
	}
}

// Usage errors exit 2 and say what was wrong; the help names where the
// database and the schema come from; ui refuses an unmigrated schema at
// start instead of serving 500s.
func TestUsageErrorsAndStartChecks(t *testing.T) {
	c := newCLI(t)
	for _, tc := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"leases", "extra-arg"}, exitUsage, "leases takes no arguments"},
		{[]string{"release", ""}, exitUsage, `lease name "": `},
		{[]string{"release", strings.Repeat("x", 10000), "--yes"}, exitUsage, "lease name"},
		{[]string{"groups", "a", "b"}, exitUsage, "at most one consumer group name"},
		{[]string{"help"}, exitOK, "$PGFENCE_SCHEMA"},
		{[]string{"help"}, exitOK, "$DATABASE_URL"},
		{[]string{"--schema", "pgfence_not_migrated", "ui", "--listen", "127.0.0.1:0"}, exitError, "migrate up"},
	} {
		out, code := c.run("", tc.args...)
		if code != tc.code || !strings.Contains(out, tc.says) {
			t.Errorf("pgfence %v: exit %d, want %d and %q\n%s", tc.args, code, tc.code, tc.says, out)
		}
	}
}

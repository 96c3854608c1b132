package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// jobs status, run, pause and resume steer a running runner: status names
// the leader, run --wait exits with the run's outcome, pause shows who
// paused; unknown jobs and shards exit 4, misuse 2. The JSON of jobs status
// has exactly the fields README documents.
func TestJobsCommandsSteerTheRunner(t *testing.T) {
	c := newCLI(t)
	pool := pgtest.NewPool(t, "cli-jobs-steer")
	client, err := lock.New(pool, lock.Config{Schema: c.schema, Holder: "replica-1", Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close(context.Background())
	r, err := runner.New(client, runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	ok := func(context.Context, *runner.Run) error { return nil }
	broken := func(context.Context, *runner.Run) error { return errors.New("the report server is down") }
	for _, j := range []runner.Job{{Name: "report", Schedule: "@every 1h", Run: ok}, {Name: "broken", Schedule: "@daily", Run: broken}} {
		if err := r.Register(j); err != nil {
			t.Fatal(err)
		}
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stopRunner := sync.OnceValue(func() error { stop(); return <-done })
	defer func() {
		if err := stopRunner(); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	// status reads jobs status --json; it exits 6 while a job has no
	// leader (the message follows the JSON).
	status := func(args ...string) []map[string]any {
		t.Helper()
		out, code := c.run("", append([]string{"jobs", "status", "--json"}, args...)...)
		var v []map[string]any
		if code != 0 && code != exitNoLeader || json.NewDecoder(strings.NewReader(out)).Decode(&v) != nil {
			t.Fatalf("jobs status --json: exit %d\n%s", code, out)
		}
		return v
	}
	pgtest.Eventually(t, 10*time.Second, "both jobs to have a leader", func() bool {
		v := status()
		return len(v) == 2 && v[0]["leader"] == "replica-1" && v[1]["leader"] == "replica-1"
	})
	v := status("report")
	if len(v) != 1 || v[0]["job"] != "report" || v[0]["paused"] != false {
		t.Fatalf("jobs status report: %v", v)
	}
	if tok, isString := v[0]["token"].(string); !isString || tok == "" || tok == "0" {
		t.Fatalf("token %v: want the leader's token as a decimal string", v[0]["token"])
	}
	var keys []string
	for k := range v[0] {
		keys = append(keys, k)
	}
	if want := documentedStatusFields(t); !slices.Equal(sorted(keys), want) {
		t.Fatalf("jobs status --json fields %v; README documents %v", sorted(keys), want)
	}
	if out, code := c.run("", "jobs", "status"); code != 0 || !strings.Contains(out, "replica-1") || !strings.Contains(out, "LEADER") {
		t.Fatalf("jobs status: exit %d\n%s", code, out)
	}
	defer func() {
		// Once the only replica has stopped, its jobs run nowhere: the
		// listing, then exit 6 naming them.
		if err := stopRunner(); err != nil {
			t.Fatalf("Run: %v", err)
		}
		out, code := c.run("", "jobs", "status")
		if code != exitNoLeader || !strings.Contains(out, "JOB") || !strings.Contains(out, "2 without a leader") ||
			!strings.Contains(out, "report") || !strings.Contains(out, "broken") {
			t.Errorf("jobs status with no replica running: exit %d, want %d, the listing and both jobs named\n%s", code, exitNoLeader, out)
		}
	}()

	if out, code := c.run("", "jobs", "run", "report", "--wait", "--timeout", "30s"); code != exitOK || !strings.Contains(out, "succeeded") {
		t.Fatalf("jobs run report --wait: exit %d\n%s", code, out)
	}
	if out, code := c.run("", "jobs", "run", "broken", "--wait"); code != exitRunFailed || !strings.Contains(out, "the report server is down") {
		t.Fatalf("jobs run broken --wait: exit %d, want %d\n%s", code, exitRunFailed, out)
	}
	if out, code := c.run("", "jobs", "--job", "report", "--json"); code != 0 || !strings.Contains(out, `"kind": "manual"`) {
		t.Fatalf("jobs --job report: the manual run is not in the ledger: exit %d\n%s", code, out)
	}

	if out, code := c.run("", "jobs", "pause", "report"); code != 0 || !strings.Contains(out, "paused") {
		t.Fatalf("jobs pause: exit %d\n%s", code, out)
	}
	if v := status("report"); v[0]["paused"] != true || !strings.HasPrefix(v[0]["paused_by"].(string), "pgfence-cli:") {
		t.Fatalf("after pause: %v", v)
	}
	// Pausing again changes nothing, and says so.
	if out, code := c.run("", "jobs", "pause", "report"); code != 0 || !strings.Contains(out, "already paused by pgfence-cli:") {
		t.Fatalf("jobs pause of a paused job: exit %d\n%s", code, out)
	}
	if out, code := c.run("", "jobs", "resume", "report"); code != 0 {
		t.Fatalf("jobs resume: exit %d\n%s", code, out)
	}
	if v := status("report"); v[0]["paused"] != false {
		t.Fatalf("after resume: %v", v)
	}

	for _, tc := range []struct {
		args []string
		code int
		says string
	}{
		{[]string{"jobs", "run", "nope"}, exitNoJob, `no job "nope"`},
		{[]string{"jobs", "pause", "nope"}, exitNoJob, `no job "nope"`},
		{[]string{"jobs", "resume", "nope"}, exitNoJob, `no job "nope"`},
		{[]string{"jobs", "status", "nope"}, exitNoJob, `no job "nope"`},
		{[]string{"jobs", "run", "report", "--shard", "1"}, exitNoJob, "no such shard"},
		{[]string{"jobs", "run"}, exitUsage, "exactly one job name"},
		{[]string{"jobs", "run", "report", "--timeout", "1s"}, exitUsage, "goes with --wait"},
		{[]string{"jobs", "pause"}, exitUsage, "exactly one job name"},
		{[]string{"jobs", "status", "a", "b"}, exitUsage, "at most one job name"},
		{[]string{"jobs", "--status", "bogus"}, exitUsage, "--status must be one of"},
		{[]string{"jobs", "bogus"}, exitUsage, "unknown jobs subcommand"},
		{[]string{"jobs", "run", ""}, exitUsage, `job name "": `},
		{[]string{"jobs", "pause", strings.Repeat("x", 10000)}, exitUsage, "job name"},
	} {
		if out, code := c.run("", tc.args...); code != tc.code || !strings.Contains(out, tc.says) {
			t.Errorf("pgfence %v: exit %d, want %d and %q\n%s", tc.args, code, tc.code, tc.says, out)
		}
	}
	if out, code := c.run("", "jobs", "--status", "skipped"); code != 0 {
		t.Errorf("jobs --status skipped: exit %d\n%s", code, out)
	}
}

// documentedStatusFields reads the field names of the JSON example under
// README's "pgfence jobs status --json" heading.
func documentedStatusFields(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, after, found := strings.Cut(string(b), "`pgfence jobs status --json`")
	_, block, found2 := strings.Cut(after, "```json\n")
	block, _, found3 := strings.Cut(block, "```")
	if !found || !found2 || !found3 {
		t.Fatal("README.md has no ```json example after `pgfence jobs status --json`")
	}
	var v []map[string]any
	if err := json.Unmarshal([]byte(block), &v); err != nil || len(v) == 0 {
		t.Fatalf("README's jobs status example: %v", err)
	}
	var keys []string
	for k := range v[0] {
		keys = append(keys, k)
	}
	return sorted(keys)
}

func sorted(s []string) []string { slices.Sort(s); return s }

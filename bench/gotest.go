package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
)

// goBench runs Go benchmarks of the repository at root (the runner's, which
// need its internals to run slots back to back) and returns, per benchmark,
// each reported metric's values over the runs.
func goBench(ctx context.Context, root, dbURL, pattern, benchtime string, runs int) (map[string]map[string][]float64, error) {
	cmd := exec.CommandContext(ctx, "go", "test", "-run", "^$", "-bench", pattern, "-benchtime", benchtime,
		"-count", strconv.Itoa(runs), "./runner")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "TEST_DATABASE_URL="+dbURL)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	raw, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go test -bench %s: %w\n%s%s", pattern, err, raw, stderr.Bytes())
	}
	got := map[string]map[string][]float64{}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") {
			continue
		}
		name := f[0]
		if i := strings.LastIndexByte(name, '-'); i > 0 {
			name = name[:i] // the GOMAXPROCS suffix
		}
		if got[name] == nil {
			got[name] = map[string][]float64{}
		}
		for i := 2; i+1 < len(f); i += 2 { // after the iteration count: value unit pairs
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				return nil, fmt.Errorf("go test -bench %s: cannot read %q", pattern, line)
			}
			got[name][f[i+1]] = append(got[name][f[i+1]], v)
		}
	}
	return got, nil
}

// repoRoot returns the repository of the library this command measures:
// the parent of the module's directory, as bench/go.mod's replace says.
func repoRoot() (string, error) {
	root, err := filepath.Abs("..")
	if err != nil {
		return "", err
	}
	mod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil || !bytes.HasPrefix(mod, []byte("module github.com/pgfence/pgfence\n")) {
		return "", fmt.Errorf("run this command from the bench directory of the pgfence repository (go run -C bench .)")
	}
	return root, nil
}

// runnerRows writes the runner's overhead per run and the sharded fleet's
// balance, from the runner package's benchmarks.
func (b *bench) runnerRows(ctx context.Context, out *bytes.Buffer) error {
	root, err := repoRoot()
	if err != nil {
		return err
	}
	over, err := goBench(ctx, root, b.url, "^BenchmarkRunOverhead$", "4000x", 3)
	if err != nil {
		return err
	}
	o := over["BenchmarkRunOverhead"]
	if len(o["overhead_us/run"]) == 0 {
		return fmt.Errorf("BenchmarkRunOverhead reported no overhead")
	}
	fmt.Fprintf(out, "\n### Runner overhead per run\n\nFrom `go test -run '^$' -bench RunOverhead -benchtime 4000x -count 3 ./runner`: "+
		"a job whose body is one autocommitted INSERT, run slot after slot through the runner (the fenced claim in the "+
		"ledger, the body, the fenced success record) against calling the body bare, the two alternating in rounds.\n\n"+
		"| | round trips / run | µs / run |\n|---|---|---|\n"+
		"| body alone | %s | %s |\n| through the runner | %s | %s |\n| overhead | | %s |\n",
		summary(o["bare_roundtrips/run"], "%.0f"), summary(o["bare_us/run"], "%.0f"),
		summary(o["runner_roundtrips/run"], "%.0f"), summary(o["runner_us/run"], "%.0f"), summary(o["overhead_us/run"], "%.0f"))

	fleet, err := goBench(ctx, root, b.url, "^BenchmarkShardFleet$", "1x", 1)
	if err != nil {
		return err
	}
	fmt.Fprint(out, "\n### 1,024 shards over 8 instances\n\nFrom `go test -run '^$' -bench ShardFleet -benchtime 1x ./runner`: eight "+
		"runner instances in one process (5-connection pools, default timings) start with 1,024 shards of one job, all at once "+
		"or one every 250 ms; then a ninth joins and one leaves gracefully. The fewest shards a change can move: 114.\n\n"+
		"| | together | staggered |\n|---|---|---|\n")
	t, s := fleet["BenchmarkShardFleet/together"], fleet["BenchmarkShardFleet/staggered"]
	for _, row := range []struct{ label, metric, format string }{
		{"acquisitions per shard until every shard ran", "acquisitions/shard_at_start", "%.2f"},
		{"leases lost on the way", "leases_lost_at_start", "%.0f"},
		{"time until every shard had run (s)", "s_until_every_shard_ran", "%.1f"},
		{"max / min shards per instance, then", "max/min_shards_per_instance", "%.2f"},
		{"shards moved when a 9th joins", "moved_on_join", "%.0f"},
		{"... until the new owners hold them (s)", "s_join_settled", "%.2f"},
		{"shards moved when one leaves gracefully", "moved_on_leave", "%.0f"},
		{"... until the new owners hold them (s)", "s_leave_settled", "%.2f"},
	} {
		if len(t[row.metric]) == 0 || len(s[row.metric]) == 0 {
			return fmt.Errorf("BenchmarkShardFleet reported no %s", row.metric)
		}
		fmt.Fprintf(out, "| %s | "+row.format+" | "+row.format+" |\n", row.label, t[row.metric][0], s[row.metric][0])
	}
	return nil
}

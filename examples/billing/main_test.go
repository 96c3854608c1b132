package main

import (
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The example is run as a user runs it (a built binary, workers in separate
// processes paused with SIGSTOP), against the test database.
func TestBillingStory(t *testing.T) {
	bin := pgtest.Build(t, ".")
	run := func(args ...string) string {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.URL(t))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("billing %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	count := func(out, label string) int {
		m := regexp.MustCompile(`(?m)^` + label + `: (\d+)`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no %q line in:\n%s", label, out)
		}
		n, _ := strconv.Atoi(m[1])
		return n
	}

	schema := pgtest.Schema(t, "billing")
	fenced := run("-schema", schema)
	t.Log("\n" + fenced)
	if !strings.Contains(fenced, "paused (SIGSTOP)") || !strings.Contains(fenced, "REFUSED: stale token") {
		t.Fatalf("the fenced story did not play out:\n%s", fenced)
	}
	if d, r := count(fenced, "duplicates"), count(fenced, "stale writes refused"); d != 0 || r < 1 {
		t.Fatalf("fenced: duplicates=%d refused=%d", d, r)
	}
	if !strings.Contains(fenced, "customers charged: 5 of 5") {
		t.Fatalf("fenced run did not charge everyone:\n%s", fenced)
	}

	unfenced := run("-schema", schema, "-unfenced")
	if d := count(unfenced, "duplicates"); d < 1 {
		t.Fatalf("unfenced run shows no duplicate charge:\n%s", unfenced)
	}
}

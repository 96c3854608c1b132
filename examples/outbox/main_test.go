package main

import (
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The relay is run as a user runs it: a built binary, relay replicas in
// separate processes, one frozen (SIGSTOP) past its lease in the middle of
// a batch, one killed (SIGKILL) and restarted, one added and removed, while
// the orders service writes. Fenced, every event arrives exactly once and
// in order per order, and the frozen relay's batch is refused; without the
// fence (the negative control) the same story delivers duplicates.
func TestOutboxExactlyOnce(t *testing.T) {
	bin := pgtest.Build(t, ".")
	run := func(args ...string) string {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.URL(t))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("outbox %v: %v\n%s", args, err, out)
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
	figures := regexp.MustCompile(`(?ms)^events written:.*`)

	schema := pgtest.Schema(t, "outbox")
	fenced := run("-schema", schema)
	t.Log("fenced:\n" + figures.FindString(fenced))
	written := count(fenced, "events written")
	if d, o, n := count(fenced, "duplicates"), count(fenced, "out of order"), count(fenced, "delivered"); d != 0 || o != 0 || n != written {
		t.Fatalf("fenced: %d delivered of %d written, %d duplicates, %d out of order:\n%s", n, written, d, o, fenced)
	}
	if r := count(fenced, "stale batches refused"); r < 1 {
		t.Fatalf("fenced: the frozen relay's batch was not refused:\n%s", fenced)
	}

	unfenced := run("-schema", schema, "-unfenced")
	t.Log("unfenced:\n" + figures.FindString(unfenced))
	if d := count(unfenced, "duplicates"); d < 1 {
		t.Fatalf("unfenced: no duplicate delivery, so the control shows nothing:\n%s", unfenced)
	}
}

package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestCompactionTotalsMatch(t *testing.T) {
	bin := pgtest.Build(t, ".")
	cmd := exec.Command(bin, "-schema", pgtest.Schema(t, "compaction"), "-for", "2s")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.URL(t))
	out, err := cmd.CombinedOutput()
	t.Log("\n" + string(out))
	if err != nil {
		t.Fatalf("compaction: %v", err)
	}
	if !strings.Contains(string(out), "summary totals equal raw totals: yes") {
		t.Fatal("summary does not match the events")
	}
}

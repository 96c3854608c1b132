package migrations_test

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

var update = flag.Bool("update", false, "rewrite testdata/schema.sql from the migrations")

// golden is the schema as the migrations create it, shared across packages.
var golden = filepath.Join("..", "testdata", "schema.sql")

const goldenHeader = `-- pgfence's schema as migrations.Up creates it: pg_dump --schema-only of a
-- migrated schema, normalised (schema renamed "pgfence", comments and
-- settings removed). Generated, do not edit: after changing a migration, run
--   go test ./migrations -run TestGoldenSchema -update
-- and review the difference.
`

// The migrations and the golden schema agree. A migration that
// changes the schema fails this test until testdata/schema.sql is
// regenerated (-update) and the change reviewed.
func TestGoldenSchema(t *testing.T) {
	ctx := pgtest.Context(t, time.Minute)
	pool := pgtest.NewPool(t, "migrations-golden")
	schema := pgtest.Schema(t, "golden")
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("pg_dump"); err != nil {
		pgtest.NeedTool(t, fmt.Errorf("the golden-schema test needs pg_dump (Debian: apt-get install postgresql-client): %w", err), exec.ErrNotFound)
	}
	out, err := exec.Command("pg_dump", "--schema-only", "--no-owner", "--no-privileges", "-n", schema, pgtest.URL(t)).Output()
	if err != nil {
		t.Fatalf("pg_dump: %v", err)
	}
	got := goldenHeader + normalise(string(out), schema)
	if *update {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (generate it with -update)", err)
	}
	if got != string(want) {
		t.Fatalf("the migrations no longer create %s; if that is intended, run\n"+
			"  go test ./migrations -run TestGoldenSchema -update\nand review the difference. First difference:\n%s",
			golden, firstDiff(string(want), got))
	}
}

var bakedTimeline = regexp.MustCompile(`(\$\$SELECT )\d+(::bigint\$\$)`)

// normalise removes what varies between dumps (comments, session settings,
// pg_dump's \restrict key) and names the schema "pgfence".
func normalise(dump, schema string) string {
	var b strings.Builder
	blank := true
	sc := bufio.NewScanner(strings.NewReader(dump))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "--"), strings.HasPrefix(line, `\restrict`), strings.HasPrefix(line, `\unrestrict`),
			strings.HasPrefix(line, "SET "), strings.HasPrefix(line, "SELECT pg_catalog.set_config"):
			continue
		case strings.TrimSpace(line) == "":
			if !blank {
				b.WriteString("\n")
			}
			blank = true
			continue
		}
		blank = false
		// pgfence_epoch_timeline's body is the server's timeline, baked in.
		line = bakedTimeline.ReplaceAllString(line, "${1}N${2}")
		b.WriteString(strings.ReplaceAll(line, schema, "pgfence") + "\n")
	}
	return strings.TrimRight(b.String(), "\n") + "\n"
}

func firstDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	for i := range max(len(w), len(g)) {
		var a, b string
		if i < len(w) {
			a = w[i]
		}
		if i < len(g) {
			b = g[i]
		}
		if a != b {
			var buf bytes.Buffer
			fmt.Fprintf(&buf, "line %d:\n  golden:     %s\n  migrations: %s", i+1, a, b)
			return buf.String()
		}
	}
	return "(none)"
}

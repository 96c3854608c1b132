package lock_test

import (
	"os/exec"
	"strings"
	"testing"
)

// The packages that use a migrated schema do not build the migration
// tooling: no goose, no database/sql driver, in what lock, fence and runner
// import (only migrations and the CLI do).
func TestLeaseUsersDoNotImportTheMigrationTooling(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/pgfence/pgfence/lock",
		"github.com/pgfence/pgfence/fence", "github.com/pgfence/pgfence/runner").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, pkg := range strings.Fields(string(out)) {
		if strings.Contains(pkg, "pressly/goose") || strings.HasSuffix(pkg, "pgx/v5/stdlib") ||
			strings.Contains(pkg, "sqlite") || pkg == "github.com/pgfence/pgfence/migrations" {
			t.Errorf("lock, fence or runner depends on %s", pkg)
		}
	}
}

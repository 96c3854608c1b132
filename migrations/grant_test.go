package migrations_test

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

// newRole creates a login role with no privileges, dropped when the test ends.
func newRole(t *testing.T, owner *pgxpool.Pool, prefix string) string {
	t.Helper()
	role := prefix + "_" + strings.ToLower(pgtest.UniqueName("r")[2:])
	if _, err := owner.Exec(context.Background(), "CREATE ROLE "+role+" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = owner.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role) })
	return role
}

// A role without pgfence's grants is told which grant to run, by every entry
// point, and a schema it cannot use is reported as that, never as "not
// migrated"; a role with exactly the application's grants sees the
// migration status.
func TestMissingGrantsNameTheGrant(t *testing.T) {
	ctx := pgtest.Context(t, time.Minute)
	owner := pgtest.NewPool(t, "grant-owner")
	schema := pgtest.Schema(t, "grant")
	if _, err := migrations.Up(ctx, owner, schema); err != nil {
		t.Fatal(err)
	}
	role := newRole(t, owner, "pgfence_nogrant")
	pool := pgtest.NewPool(t, "grant-none", func(c *pgxpool.Config) { c.ConnConfig.User = role })
	want := "grant app " + role
	check := func(what string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "not migrated") {
			t.Errorf("%s without grants: %v; want an error that names %q", what, err, want)
		}
	}
	_, err := migrations.Up(ctx, pool, schema)
	check("migrations.Up", err)
	_, err = migrations.Status(ctx, pool, schema)
	check("migrations.Status", err)
	check("migrations.Verify", migrations.Verify(ctx, pool, schema))

	lc, err := lock.New(pool, lock.Config{Schema: schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close(ctx)
	_, err = lc.TryAcquire(ctx, "billing")
	check("lock.TryAcquire", err)
	_, err = lock.Leases(ctx, lc.Pool(), lc.Config().Schema)
	check("lock.Leases", err)
	_, err = runner.Runs(ctx, pool, schema, runner.RunFilter{})
	check("runner.Runs", err)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return fence.Guard{Lease: "billing", Token: 1, Schema: schema}.Check(ctx, tx)
	})
	check("fence.Guard.Check", err)

	// With the application's grants, the status is readable.
	if err := migrations.GrantApp(ctx, owner, schema, role); err != nil {
		t.Fatal(err)
	}
	if st, err := migrations.Status(ctx, pool, schema); err != nil || st.Current != migrations.Latest || st.Epoch == nil {
		t.Fatalf("Status with the application's grants: %+v, %v", st, err)
	}
}

// README's list of what the application role may EXECUTE is AppGrants'.
func TestREADMEListsTheAppGrants(t *testing.T) {
	stmts, err := migrations.AppGrants("s", "r")
	if err != nil {
		t.Fatal(err)
	}
	var granted []string
	for _, st := range stmts {
		if strings.HasPrefix(st, "GRANT EXECUTE") {
			for _, m := range regexp.MustCompile(`"(pgfence_[a-z_]+)"\(`).FindAllStringSubmatch(st, -1) {
				granted = append(granted, m[1])
			}
		}
	}
	readme, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	para := regexp.MustCompile(`(?s)EXECUTE on (.*?)\(not granted to PUBLIC\)`).FindSubmatch(readme)
	if para == nil {
		t.Fatal("README.md has no \"EXECUTE on ... (not granted to PUBLIC)\" list")
	}
	var listed []string
	for _, m := range regexp.MustCompile("`(pgfence_[a-z_]+)`").FindAllSubmatch(para[1], -1) {
		listed = append(listed, string(m[1]))
	}
	slices.Sort(granted)
	slices.Sort(listed)
	if !slices.Equal(granted, listed) {
		t.Fatalf("README lists EXECUTE on %v; AppGrants grants %v", listed, granted)
	}
}

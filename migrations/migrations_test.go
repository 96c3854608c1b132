package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

func TestMain(m *testing.M) {
	if schema := os.Getenv(childEnv); schema != "" {
		os.Exit(migrateChild(schema))
	}
	pgtest.Main(m)
}

// childEnv makes the test binary a process that runs migrations.Up once on
// the schema it names, for TestConcurrentUp.
const childEnv = "PGFENCE_MIGRATE_CHILD"

func migrateChild(schema string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := pgxpool.New(ctx, os.Getenv(pgtest.EnvURL))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer pool.Close()
	v, err := migrations.Up(ctx, pool, schema)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(v)
	return 0
}

// Replicas that migrate at start-up all succeed. 16 goroutines,
// then 8 processes, each against a schema that does not exist yet, all call
// Up at once: every one ends with a nil error at the latest version (before
// the fix, most failed with 23505 from CREATE SCHEMA IF NOT EXISTS, and
// goose's polling locker made the rest wait in 5 s steps).
func TestConcurrentUp(t *testing.T) {
	ctx := pgtest.Context(t, 2*time.Minute)
	pool := pgtest.NewPool(t, "migrations-concurrent", func(c *pgxpool.Config) { c.MaxConns = 20 })

	schema := pgtest.Schema(t, "together")
	var wg sync.WaitGroup
	errs := make([]error, 16)
	versions := make([]int64, 16)
	start := make(chan struct{})
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			versions[i], errs[i] = migrations.Up(ctx, pool, schema)
		}()
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil || versions[i] != migrations.Latest {
			t.Errorf("goroutine %d: version %d, %v; want %d, nil", i, versions[i], err, migrations.Latest)
		}
	}

	schema = pgtest.Schema(t, "together_proc")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmds := make([]*exec.Cmd, 8)
	outs := make([]*strings.Builder, 8)
	for i := range cmds {
		outs[i] = &strings.Builder{}
		cmds[i] = exec.CommandContext(ctx, exe)
		cmds[i].Env = append(os.Environ(), childEnv+"="+schema)
		cmds[i].Stdout, cmds[i].Stderr = outs[i], outs[i]
	}
	for _, c := range cmds {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range cmds {
		if err := c.Wait(); err != nil || strings.TrimSpace(outs[i].String()) != fmt.Sprint(migrations.Latest) {
			t.Errorf("process %d: %v, output %q; want version %d", i, err, outs[i].String(), migrations.Latest)
		}
	}
}

// Looking changes nothing. Status and Verify on a mistyped
// schema report it missing and create nothing; on an existing but empty
// schema, "not migrated"; on an old version, what was found and what is
// needed, with the command to run.
func TestStatusAndVerifyOnlyRead(t *testing.T) {
	ctx := pgtest.Context(t, time.Minute)
	pool := pgtest.NewPool(t, "migrations-readonly")
	typo := pgtest.Schema(t, "typo")

	st, err := migrations.Status(ctx, pool, typo)
	if err != nil {
		t.Fatal(err)
	}
	if st.SchemaExists || st.Current != 0 || st.Latest != migrations.Latest || st.Epoch != nil {
		t.Fatalf("Status of a missing schema: %+v", st)
	}
	err = migrations.Verify(ctx, pool, typo)
	var nm *migrations.NotMigratedError
	if !errors.As(err, &nm) || !errors.Is(err, migrations.ErrNotMigrated) || nm.SchemaExists ||
		!strings.Contains(err.Error(), "does not exist") || !strings.Contains(err.Error(), "migrate up") {
		t.Fatalf("Verify of a missing schema: %v", err)
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, typo).Scan(&exists); err != nil || exists {
		t.Fatalf("looking at schema %q created it (%v)", typo, err)
	}

	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{typo}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	err = migrations.Verify(ctx, pool, typo)
	if !errors.As(err, &nm) || !nm.SchemaExists || nm.Found != 0 || !strings.Contains(err.Error(), "not migrated") {
		t.Fatalf("Verify of an empty schema: %v", err)
	}
	var tables int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, typo).Scan(&tables); err != nil || tables != 0 {
		t.Fatalf("looking at schema %q created %d tables (%v)", typo, tables, err)
	}

	// An old version: migrate to 2 by hand.
	p, err := migrations.NewProvider(pool, typo)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := p.UpTo(ctx, 2); err != nil {
		t.Fatal(err)
	}
	err = migrations.Verify(ctx, pool, typo)
	if !errors.As(err, &nm) || nm.Found != 2 || nm.Required != migrations.Latest ||
		!strings.Contains(err.Error(), fmt.Sprintf("version 2, this pgfence needs %d", migrations.Latest)) {
		t.Fatalf("Verify of version 2: %v", err)
	}
	if _, err := migrations.Up(ctx, pool, typo); err != nil {
		t.Fatal(err)
	}
	if err := migrations.Verify(ctx, pool, typo); err != nil {
		t.Fatalf("Verify after Up: %v", err)
	}
}

// Every schema name that validation accepts can be migrated, and
// names the migrations could not handle are refused up front.
func TestSchemaNames(t *testing.T) {
	ctx := pgtest.Context(t, 2*time.Minute)
	pool := pgtest.NewPool(t, "migrations-names")
	for _, name := range []string{`Upper`, `with space`, `semi;colon`, `quote'd`, `per%cent`, `ünï`, `back\slash`} {
		schema := name + "_" + pgtest.UniqueName("n")[2:]
		t.Cleanup(func() {
			_, _ = pool.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		})
		if _, err := migrations.Up(ctx, pool, schema); err != nil {
			t.Errorf("Up(%q): %v", schema, err)
		}
	}
	for _, bad := range []string{"a$body$b", "x$", "nul\x00"} {
		if _, err := migrations.Up(ctx, pool, bad); err == nil {
			t.Errorf("Up(%q) was accepted", bad)
		}
	}
}

// Up is idempotent, uses pgfence's own version table, and works in a schema
// whose name needs quoting; the fence function works from any search_path.
func TestUpStatusAndQuoting(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := pgtest.NewPool(t, "migrations-test")
	schema := `My "odd" Schema ` + pgtest.UniqueName("x")
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})
	v1, err := migrations.Up(ctx, pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	v2, err := migrations.Up(ctx, pool, schema)
	if err != nil || v2 != v1 || v1 < 3 {
		t.Fatalf("Up twice: %d then %d, %v", v1, v2, err)
	}
	st, err := migrations.Status(ctx, pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	if !st.SchemaExists || st.Current != migrations.Latest || len(st.Migrations) == 0 || st.Epoch == nil || st.Epoch.FirstToken != 1 {
		t.Fatalf("Status: %+v, want the schema at version %d, tokens from 1", st, migrations.Latest)
	}
	for _, s := range st.Migrations {
		if s.AppliedAt.IsZero() {
			t.Errorf("migration %d not applied", s.Version)
		}
	}
	var own, goose bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL`,
		ident.Table(schema, migrations.VersionTable), ident.Table(schema, "goose_db_version")).Scan(&own, &goose); err != nil {
		t.Fatal(err)
	}
	if !own || goose {
		t.Fatalf("version tables: pgfence_db_version=%v goose_db_version=%v", own, goose)
	}
	// The check function finds its table from a connection whose
	// search_path does not include the schema.
	var issued, tok int64
	if err := pool.QueryRow(ctx, "INSERT INTO "+ident.Table(schema, "pgfence_leases")+
		" (name, acquired_at) VALUES ('l', now()) RETURNING token").Scan(&issued); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, "SELECT "+ident.Table(schema, "pgfence_check")+"('l', $1)", issued).Scan(&tok); err != nil || tok != issued {
		t.Fatalf("pgfence_check from another search_path: %d, %v; want %d", tok, err, issued)
	}
	if _, err := migrations.Up(ctx, nil, schema); !errors.Is(err, migrations.ErrNilPool) {
		t.Fatalf("nil pool: %v", err)
	}
	if _, err := migrations.Up(ctx, pool, strings.Repeat("s", 64)); err == nil {
		t.Fatal("a 64-byte schema name was accepted")
	}
}

// Undoing the leases migration does not silently destroy the
// token history: its Down refuses (PF011) unless the migrating session opts
// in with pgfence.allow_token_reset = 'on'.
func TestDownKeepsTheTokenHistory(t *testing.T) {
	ctx := pgtest.Context(t, time.Minute)
	pool := pgtest.NewPool(t, "migrations-down")
	schema := pgtest.Schema(t, "down")
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	c, err := lock.New(pool, lock.Config{Schema: schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.TryAcquire(ctx, "history")
	if err != nil {
		t.Fatal(err)
	}
	_ = c.Close(ctx)
	p, err := migrations.NewProvider(pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	_, err = p.DownTo(ctx, 0)
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || pg.Code != "PF011" {
		t.Fatalf("Down to 0: %v, want PF011", err)
	}
	var tok int64
	if err := pool.QueryRow(ctx, "SELECT token FROM "+ident.Table(schema, "pgfence_leases")+" WHERE name = 'history'").Scan(&tok); err != nil || tok != int64(l.Token()) {
		t.Fatalf("after a refused Down the token history is %d, %v; want %d", tok, err, l.Token())
	}
	optIn := pgtest.NewPool(t, "migrations-down-optin", func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["pgfence.allow_token_reset"] = "on"
	})
	p2, err := migrations.NewProvider(optIn, schema)
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	if _, err := p2.DownTo(ctx, 0); err != nil {
		t.Fatalf("Down to 0 with the opt-in: %v", err)
	}
	var gone bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NULL", ident.Table(schema, "pgfence_leases")).Scan(&gone); err != nil || !gone {
		t.Fatalf("with the opt-in the leases table is still there (%v)", err)
	}
}

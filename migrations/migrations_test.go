package migrations_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

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
	for _, s := range st {
		if s.AppliedAt.IsZero() {
			t.Errorf("migration %d not applied", s.Source.Version)
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
	if _, err := pool.Exec(ctx, "INSERT INTO "+ident.Table(schema, "pgfence_leases")+
		" (name, token, acquired_at, renewed_at, expires_at) VALUES ('l', 3, now(), now(), now())"); err != nil {
		t.Fatal(err)
	}
	var tok int64
	if err := pool.QueryRow(ctx, "SELECT "+ident.Table(schema, "pgfence_check")+"('l', 3)").Scan(&tok); err != nil || tok != 3 {
		t.Fatalf("pgfence_check from another search_path: %d, %v", tok, err)
	}
	if _, err := migrations.Up(ctx, nil, schema); !errors.Is(err, migrations.ErrNilPool) {
		t.Fatalf("nil pool: %v", err)
	}
	if _, err := migrations.Up(ctx, pool, strings.Repeat("s", 64)); err == nil {
		t.Fatal("a 64-byte schema name was accepted")
	}
}

package migrations_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
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
	var issued, tok int64
	if err := pool.QueryRow(ctx, "INSERT INTO "+ident.Table(schema, "pgfence_leases")+
		" (name, acquired_at, renewed_at, expires_at) VALUES ('l', now(), now(), now()) RETURNING token").Scan(&issued); err != nil {
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

// Upgrading a schema that already issued tokens (version 3, tokens raised by
// the library as token + 1) to the token sequence (version 4) keeps tokens
// rising for existing and new leases; going back down restores the old
// guards, and up again still starts above every token issued.
func TestTokenSequenceUpgrade(t *testing.T) {
	ctx := pgtest.Context(t, time.Minute)
	pool := pgtest.NewPool(t, "migrations-upgrade")
	schema := pgtest.Schema(t, "upgrade")
	q := pgx.Identifier{schema}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+q); err != nil {
		t.Fatal(err)
	}
	cfg := pool.Config().ConnConfig.Copy()
	cfg.RuntimeParams["search_path"] = q
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { _ = db.Close() })
	p, err := migrations.NewProvider(db, 424242)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 3); err != nil {
		t.Fatal(err)
	}
	tbl := ident.Table(schema, "pgfence_leases")
	if _, err := pool.Exec(ctx, "INSERT INTO "+tbl+` (name, token, acquired_at, renewed_at, expires_at)
		VALUES ('old', 41, now(), now(), now()), ('older', 40, now(), now(), now())`); err != nil {
		t.Fatal(err)
	}
	acquire := func(name string) int64 {
		t.Helper()
		c, err := lock.New(pool, lock.Config{Schema: schema, Logger: pgtest.Quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close(ctx)
		l, err := c.TryAcquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(ctx)
		return int64(l.Token())
	}
	if _, err := p.UpTo(ctx, 4); err != nil {
		t.Fatal(err)
	}
	last := int64(41)
	for _, name := range []string{"older", "new", "old"} {
		tok := acquire(name)
		if tok <= last {
			t.Fatalf("%s after upgrade: token %d, want above %d", name, tok, last)
		}
		last = tok
	}
	if _, err := p.DownTo(ctx, 3); err != nil {
		t.Fatal(err)
	}
	var pg *pgconn.PgError
	if _, err := pool.Exec(ctx, "UPDATE "+tbl+" SET token = token - 1"); !errors.As(err, &pg) || pg.Code != "PF010" {
		t.Fatalf("after down to 3, token decrease: %v, want PF010", err)
	}
	// Version 3's library raised tokens by one; do it by hand, as it would.
	if _, err := pool.Exec(ctx, "UPDATE "+tbl+" SET token = token + 100 WHERE name = 'old'"); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if tok := acquire("new"); tok <= last+100 {
		t.Fatalf("after down and up: token %d, want above %d", tok, last+100)
	}
}

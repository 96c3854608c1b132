// Package migrations holds pgfence's schema as goose v3 SQL migrations,
// embedded in the binary.
//
// Apply them with [Up], which runs goose's Provider API with pgfence's own
// version table (pgfence_db_version) so it never touches the goose table of the
// application that imports pgfence. Applications that run their own goose
// migrations can instead fold [FS] into their run.
//
// Objects are created in the schema given to [Up] (created if missing), or in
// the first schema of the connection's search_path when it is empty. Run the
// migrations in every database and schema that holds pgfence objects: the
// leases schema, and any schema that holds a resource fence
// (fence.Resource) next to its protected data.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/pgfence/pgfence/internal/ident"
)

//go:embed sql/*.sql
var embedded embed.FS

// FS is the migrations directory: goose SQL files at its root.
var FS fs.FS = mustSub(embedded, "sql")

// VersionTable is the name of pgfence's goose version table.
const VersionTable = "pgfence_db_version"

// ErrNilPool is returned when a nil pool is passed.
var ErrNilPool = errors.New("migrations: nil pool")

func mustSub(f fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(f, dir)
	if err != nil {
		panic(err) // the embed pattern above guarantees the directory exists
	}
	return sub
}

// Up applies every pending migration in schema ("" means the connection's
// search_path) and returns the schema version reached.
func Up(ctx context.Context, pool *pgxpool.Pool, schema string) (int64, error) {
	p, closeFn, err := provider(ctx, pool, schema)
	if err != nil {
		return 0, err
	}
	defer closeFn()
	if _, err := p.Up(ctx); err != nil {
		return 0, fmt.Errorf("migrations: up: %w", err)
	}
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("migrations: version: %w", err)
	}
	return v, nil
}

// Status reports, for each embedded migration, whether it is applied in schema.
func Status(ctx context.Context, pool *pgxpool.Pool, schema string) ([]*goose.MigrationStatus, error) {
	p, closeFn, err := provider(ctx, pool, schema)
	if err != nil {
		return nil, err
	}
	defer closeFn()
	st, err := p.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: status: %w", err)
	}
	return st, nil
}

// NewProvider returns a goose Provider over db for pgfence's migrations, with
// pgfence's version table, no global registry and a session advisory lock, for
// callers that need goose's full API (down, redo, ...). db's connections decide
// the schema through their search_path.
func NewProvider(db *sql.DB, lockID int64) (*goose.Provider, error) {
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(lockID))
	if err != nil {
		return nil, err
	}
	return goose.NewProvider(goose.DialectPostgres, db, FS,
		goose.WithTableName(VersionTable),
		goose.WithDisableGlobalRegistry(true),
		goose.WithSessionLocker(locker),
	)
}

// provider opens a private database/sql handle whose connections have the
// pool's settings and search_path set to schema, so goose (which only speaks
// database/sql) creates everything there without touching the pool's own
// connections.
func provider(ctx context.Context, pool *pgxpool.Pool, schema string) (*goose.Provider, func(), error) {
	if pool == nil {
		return nil, nil, ErrNilPool
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, nil, fmt.Errorf("migrations: %w", err)
	}
	cfg := pool.Config().ConnConfig.Copy()
	if schema != "" {
		q := pgx.Identifier{schema}.Sanitize()
		if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+q); err != nil {
			return nil, nil, fmt.Errorf("migrations: create schema: %w", err)
		}
		cfg.RuntimeParams["search_path"] = q
	}
	db := stdlib.OpenDB(*cfg)
	db.SetMaxOpenConns(2)
	p, err := NewProvider(db, lockID(schema))
	if err != nil {
		_ = db.Close()
		return nil, nil, fmt.Errorf("migrations: %w", err)
	}
	return p, func() { _ = p.Close() }, nil
}

// lockID derives the advisory lock goose holds while migrating from the schema,
// so migrations of different schemas do not queue behind each other while two
// runs against the same schema still exclude each other.
func lockID(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("pgfence:" + schema))
	return int64(h.Sum64() &^ (1 << 63))
}

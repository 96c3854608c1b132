// Package migrations holds pgfence's schema as goose v3 SQL migrations,
// embedded in the binary.
//
// Apply them with [Up], which runs goose's Provider API with pgfence's own
// version table (pgfence_db_version) so it never touches the goose table of the
// application that imports pgfence. Applications that run their own goose
// migrations keep doing so for their own schema and call [Up] (or use
// [NewProvider] for goose's full API) for pgfence's: do not fold the files
// of [FS] into your own goose run, whose version numbers would collide with
// pgfence's.
//
// The history is one migration per area (leases, fences, runner), each the
// complete definition of its objects; releases add migrations after them.
// Undoing the leases migration destroys the token history, so its Down
// refuses (SQLSTATE PF011) unless the migrating session has set
// pgfence.allow_token_reset = 'on'.
//
// Objects are created in the schema given to [Up] (created if missing), or in
// [DefaultSchema] ("pgfence") when it is empty, the schema every pgfence
// entry point uses when none is named. Run the
// migrations in every database and schema that holds pgfence objects: the
// leases schema, and any schema that holds a resource fence
// (fence.Resource) next to its protected data.
//
// Up is safe to call from every replica at start-up, all at once: runs
// against the same schema wait for each other on an advisory lock (blocking,
// not polling), and every caller returns the latest version with a nil error.
// [Status] and [Verify] only read: they never create a schema or a table.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/schemaver"
	"github.com/pgfence/pgfence/internal/wait"
)

//go:embed sql/*.sql
var embedded embed.FS

// files is the migrations directory: goose SQL files at its root.
var files = mustSub(embedded, "sql")

// FS returns the migrations directory (goose SQL files at its root), for
// reading and for tools that inspect them. Apply them with Up or
// NewProvider. It is a function, not a variable, so that nothing can swap
// the migrations Up applies.
func FS() fs.FS { return files }

// VersionTable is the name of pgfence's goose version table.
const VersionTable = schemaver.VersionTable

// DefaultSchema is the schema pgfence uses when none is named, here and in
// lock.Config, runner.Config, fence.Guard, fence.Resource and the CLI.
const DefaultSchema = ident.DefaultSchema

// MinServerVersion is the oldest PostgreSQL pgfence runs on, as
// server_version_num: 13, the first with pg_current_xact_id and
// pg_xact_status on 64-bit transaction ids (how a lost COMMIT reply is
// resolved). The tests run on 15.
const MinServerVersion = 130000

// ErrUnsupportedServer is returned by Up for a server older than
// MinServerVersion.
var ErrUnsupportedServer = errors.New("migrations: unsupported PostgreSQL version")

// checkServer refuses a server_version_num below MinServerVersion.
func checkServer(num int) error {
	if num < MinServerVersion {
		return fmt.Errorf("%w: the server's server_version_num is %d; pgfence needs PostgreSQL %d or newer (%d)",
			ErrUnsupportedServer, num, MinServerVersion/10000, MinServerVersion)
	}
	return nil
}

// ErrNilPool is returned when a nil pool is passed.
var ErrNilPool = errors.New("migrations: nil pool")

func mustSub(f fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(f, dir)
	if err != nil {
		panic(err) // the embed pattern above guarantees the directory exists
	}
	return sub
}

// Up applies every pending migration in schema ("" means DefaultSchema,
// "pgfence") and returns the schema version reached. Concurrent calls for
// the same schema, from any number of goroutines or processes, queue on an
// advisory lock; each returns the latest version. It needs CREATE on the
// database only when the schema does not exist yet.
func Up(ctx context.Context, pool *pgxpool.Pool, schema string) (int64, error) {
	if err := ctxcheck.NotNil(ctx, "migrations: Up"); err != nil {
		return 0, err
	}
	if pool == nil {
		return 0, ErrNilPool
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return 0, fmt.Errorf("migrations: %w", err)
	}
	schema = ident.Schema(schema)
	var version int
	if err := pool.QueryRow(ctx, sqlServerVersion).Scan(&version); err != nil {
		return 0, fmt.Errorf("migrations: read the server version: %w", err)
	}
	if err := checkServer(version); err != nil {
		return 0, err
	}
	if err := createSchema(ctx, pool, schema); err != nil {
		return 0, err
	}
	if _, err := schemaver.Inspect(ctx, pool, schema); err != nil { // a schema the role may not use
		return 0, err
	}
	p, err := NewProvider(pool, schema)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	// Each call takes and releases the migration lock (goose); its
	// release sees ctx (withCaller).
	if _, err := p.Up(withCaller(ctx)); err != nil {
		return 0, fmt.Errorf("migrations: up: %w", hint.Wrap(err, schema, hint.Role(pool)))
	}
	v, err := p.GetDBVersion(withCaller(ctx))
	if err != nil {
		return 0, fmt.Errorf("migrations: version: %w", err)
	}
	// A schema restored from a logical dump into another cluster moves its
	// tokens past the dump's before any application acquires (see
	// pgfence_sync_epoch in 00001_leases.sql).
	if _, err := pool.Exec(ctx, syncEpochSQL(schema)); err != nil {
		return 0, fmt.Errorf("migrations: token epoch: %w", hint.Wrap(err, schema, hint.Role(pool)))
	}
	return v, nil
}

// createSchema creates schema unless it exists, under the same advisory
// lock key that migrating it takes (a transaction-level lock conflicts with
// goose's session-level one), so that replicas starting together do not race
// on CREATE SCHEMA IF NOT EXISTS (which fails with 23505 when two sessions
// create the same schema at once).
func createSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	var exists bool
	if err := pool.QueryRow(ctx, sqlSchemaExists, schema).Scan(&exists); err != nil {
		return fmt.Errorf("migrations: look up schema %q: %w", schema, err)
	}
	if exists {
		return nil
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlXactLock, lockID(schema)); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, createSchemaSQL(schema))
		return err
	})
	if err != nil {
		var pg *pgconn.PgError
		if errors.As(err, &pg) && pg.Code == hint.CodeNoPrivilege {
			err = &hint.Error{Err: err, Hint: fmt.Sprintf("role %q may not create schemas: create schema %q as its owner "+
				"and run Up as that owner, or grant the role CREATE on the database", hint.Role(pool), schema)}
		}
		return fmt.Errorf("migrations: create schema %q: %w", schema, err)
	}
	return nil
}

// MigrationStatus is one embedded migration and whether it is applied.
type MigrationStatus struct {
	// Version is the migration's version number.
	Version int64
	// Name is the migration's file name.
	Name string
	// AppliedAt is when it was applied; zero if it is pending.
	AppliedAt time.Time
}

// Report is what Status found, without changing anything.
type Report struct {
	// Schema is the schema looked at.
	Schema string
	// SchemaExists is false when the schema does not exist.
	SchemaExists bool
	// Current is the applied version (0: not migrated).
	Current int64
	// Latest is the newest embedded version, the one this pgfence needs.
	Latest int64
	// Migrations lists every embedded migration with its state.
	Migrations []MigrationStatus
	// Epoch is the history of the database the schema issues tokens in;
	// nil when the schema is not migrated.
	Epoch *Epoch
}

// Epoch is a history of the database the token sequence issues in. The
// migration starts the first; each promotion, point-in-time recovery or
// restore into another cluster starts another, whose first token is the
// promoted server's clock (milliseconds since 2026-01-01 UTC) << 22, above
// every token of the histories before it (fence.Token).
type Epoch = schemaver.Epoch

// Status reports, for each embedded migration, whether it is applied in
// schema ("" means DefaultSchema). It only reads: a mistyped schema is
// reported as missing (SchemaExists false), never created.
func Status(ctx context.Context, pool *pgxpool.Pool, schema string) (*Report, error) {
	if err := ctxcheck.NotNil(ctx, "migrations: Status"); err != nil {
		return nil, err
	}
	if pool == nil {
		return nil, ErrNilPool
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	schema = ident.Schema(schema)
	st, err := schemaver.Inspect(ctx, pool, schema)
	if err != nil {
		return nil, err
	}
	rep := &Report{Schema: schema, SchemaExists: st.Exists, Current: st.Current, Latest: Latest}
	for _, m := range sources {
		m.AppliedAt = st.Applied[m.Version]
		rep.Migrations = append(rep.Migrations, m)
	}
	if st.Current >= 1 {
		if rep.Epoch, err = schemaver.ReadEpoch(ctx, pool, schema); err != nil {
			return nil, fmt.Errorf("migrations: %w", err)
		}
	}
	return rep, nil
}

// ErrNotMigrated is matched by every *NotMigratedError.
var ErrNotMigrated = schemaver.ErrNotMigrated

// NotMigratedError says that a schema lacks pgfence's objects, or holds an
// older version of them than this pgfence needs. It matches ErrNotMigrated.
type NotMigratedError = schemaver.NotMigratedError

// Verify checks, without writing anything, that schema ("" means
// DefaultSchema) holds pgfence's objects at version Latest or newer. It
// returns a *NotMigratedError when it does not, and the database error when
// it cannot tell (for instance, the role may not use the schema: 42501,
// with the grant to run).
func Verify(ctx context.Context, db fence.DB, schema string) error {
	if err := ctxcheck.NotNil(ctx, "migrations: Verify"); err != nil {
		return err
	}
	return schemaver.Verify(ctx, db, schema)
}

// sources lists the embedded migrations by version.
var sources = mustSources()

// Latest is the newest version among the embedded migrations: the schema
// version this pgfence needs.
const Latest = schemaver.Latest

func mustSources() []MigrationStatus {
	names, err := fs.Glob(files, "*.sql")
	if err != nil {
		panic(err)
	}
	var out []MigrationStatus
	for _, n := range names {
		digits, _, _ := strings.Cut(path.Base(n), "_")
		v, err := strconv.ParseInt(digits, 10, 64)
		if err != nil {
			panic(fmt.Sprintf("migrations: %s has no version number", n))
		}
		out = append(out, MigrationStatus{Version: v, Name: n})
	}
	slices.SortFunc(out, func(a, b MigrationStatus) int { return int(a.Version - b.Version) })
	if newest := out[len(out)-1].Version; newest != schemaver.Latest {
		panic(fmt.Sprintf("migrations: the newest embedded migration is %d; set schemaver.Latest to it", newest))
	}
	return out
}

// NewProvider returns a goose Provider for pgfence's migrations in schema
// ("" means DefaultSchema), for callers that need goose's full API
// (down, redo, status by version). It is what Up uses: pgfence's version
// table, no global registry, and the same advisory lock as Up (derived from
// the schema), so it excludes concurrent Up calls on that schema. It opens
// a private database/sql handle with the pool's settings and search_path
// set to schema (goose speaks only database/sql); the schema must exist.
// goose releases the lock with the caller's deadline stripped: its
// methods may take up to 5 s (wait.CleanupTimeout) past their context's
// end when the server stops answering, where Up takes 500 ms. Close the
// provider when done.
func NewProvider(pool *pgxpool.Pool, schema string) (*goose.Provider, error) {
	if pool == nil {
		return nil, ErrNilPool
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	schema = ident.Schema(schema)
	cfg := pool.Config().ConnConfig.Copy()
	cfg.RuntimeParams["search_path"] = pgx.Identifier{schema}.Sanitize()
	db := stdlib.OpenDB(*cfg)
	db.SetMaxOpenConns(2)
	p, err := goose.NewProvider(goose.DialectPostgres, db, files,
		goose.WithTableName(VersionTable),
		goose.WithDisableGlobalRegistry(true),
		goose.WithSessionLocker(sessionLocker(lockID(schema))),
	)
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

// sessionLocker holds a session-level advisory lock while goose migrates.
// Unlike goose's own Postgres locker, which polls with pg_try_advisory_lock
// every few seconds, it blocks in pg_advisory_lock: replicas that start
// together are let in one after another as soon as the previous one is done.
type sessionLocker int64

// SessionLock implements goose's lock.SessionLocker.
func (id sessionLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	if _, err := conn.ExecContext(ctx, sqlSessionLock, int64(id)); err != nil {
		return fmt.Errorf("migrations: take the migration lock: %w", err)
	}
	return nil
}

// SessionUnlock implements goose's lock.SessionLocker. goose calls it
// once it has migrated, with the caller's cancellation and deadline
// stripped: it ends wait.PastDeadline after the caller's context does
// (which Up hands it, withCaller), or after wait.CleanupTimeout, so that
// Up returns by its deadline even when the server stops answering. An
// unlock that does not come back closes its connection; the server drops
// the lock once it sees the session gone (by its TCP keepalive, whose
// operating-system defaults take over two hours: tcp_keepalives_idle),
// and until then other Up calls on the schema wait for it. Callers of a
// NewProvider's methods get the wait.CleanupTimeout bound.
func (id sessionLocker) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	caller, ok := ctx.Value(callerKey{}).(context.Context)
	if !ok {
		caller = ctx
	}
	uctx, cancel := wait.Outlive(caller, wait.CleanupTimeout)
	defer cancel()
	_, err := conn.ExecContext(uctx, sqlSessionUnlock, int64(id))
	return err
}

// callerKey carries a caller's context to SessionUnlock, past goose's
// context.WithoutCancel.
type callerKey struct{}

// withCaller makes ctx itself readable by SessionUnlock.
func withCaller(ctx context.Context) context.Context {
	return context.WithValue(ctx, callerKey{}, ctx)
}

// lockID derives the advisory lock goose holds while migrating from the schema,
// so migrations of different schemas do not queue behind each other while two
// runs against the same schema still exclude each other.
func lockID(schema string) int64 {
	h := fnv.New64a()
	h.Write([]byte("pgfence:" + schema))
	return int64(h.Sum64() &^ (1 << 63))
}

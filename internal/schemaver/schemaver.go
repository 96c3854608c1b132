// Package schemaver reads the version of pgfence's schema without goose, so
// that the packages that only use a migrated schema (lock, runner) can check
// it without importing the migration tooling. Package migrations re-exports
// its error types and Verify.
package schemaver

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgexec"
)

// VersionTable is the name of pgfence's goose version table.
const VersionTable = "pgfence_db_version"

// Latest is the newest migration's version: the schema version this
// pgfence needs. Package migrations checks at start-up that it is the
// newest of its embedded files.
const Latest int64 = 5

// State is a schema's migration state.
type State struct {
	// Exists is false when the schema does not exist.
	Exists bool
	// Current is the newest applied version (0: not migrated).
	Current int64
	// Applied is when each applied version was applied.
	Applied map[int64]time.Time
}

// Inspect reads schema's migration state without writing anything. schema
// must be validated and not empty. A schema the role may not use is
// reported as the server reports a missing privilege (42501), with the
// grant to run, never as "not migrated".
func Inspect(ctx context.Context, q pgexec.DB, schema string) (State, error) {
	st := State{Applied: map[int64]time.Time{}}
	var table *string
	var (
		usable bool
		role   string
	)
	err := q.QueryRow(ctx, stateSQL, schema, VersionTable).Scan(&st.Exists, &usable, &role, &table)
	if err != nil {
		return st, fmt.Errorf("migrations: read the state of schema %q: %w", schema, hint.Wrap(err, schema, ""))
	}
	if st.Exists && !usable {
		denied := &pgconn.PgError{Severity: "ERROR", Code: hint.CodeNoPrivilege, Message: "permission denied for schema " + schema}
		return st, fmt.Errorf("migrations: read the state of schema %q: %w", schema, hint.Wrap(denied, schema, role))
	}
	if table == nil {
		return st, nil
	}
	rows, err := q.Query(ctx, versionsSQL(schema))
	if err != nil {
		return st, fmt.Errorf("migrations: read the version of schema %q: %w", schema, hint.Wrap(err, schema, role))
	}
	defer rows.Close()
	for rows.Next() {
		var (
			v  int64
			at time.Time
		)
		if err := rows.Scan(&v, &at); err != nil {
			return st, err
		}
		st.Applied[v] = at
		st.Current = max(st.Current, v)
	}
	return st, rows.Err()
}

// ErrNotMigrated is matched by every *NotMigratedError.
var ErrNotMigrated = errors.New("migrations: schema not migrated")

// NotMigratedError says that a schema lacks pgfence's objects, or holds an
// older version of them than this pgfence needs. It matches ErrNotMigrated.
type NotMigratedError struct {
	// Schema is the schema looked at.
	Schema string
	// SchemaExists is false when the schema does not exist at all.
	SchemaExists bool
	// Found is the applied version (0: none).
	Found int64
	// Required is the version this pgfence needs (Latest).
	Required int64
}

// Error says what was found and what to run.
func (e *NotMigratedError) Error() string {
	where := "schema " + strconv.Quote(e.Schema)
	flag := " --schema " + ident.ShellQuote(e.Schema)
	if e.Schema == ident.DefaultSchema {
		flag = ""
	}
	var found string
	switch {
	case !e.SchemaExists:
		found = where + " does not exist"
	case e.Found == 0:
		found = where + " has no pgfence tables (not migrated)"
	default:
		found = fmt.Sprintf("%s is at pgfence schema version %d, this pgfence needs %d", where, e.Found, e.Required)
	}
	return "migrations: " + found + ": run migrations.Up, or `pgfence" + flag + " migrate up`"
}

// Is makes errors.Is(err, ErrNotMigrated) true.
func (e *NotMigratedError) Is(target error) bool { return target == ErrNotMigrated }

// Verify checks, without writing anything, that schema ("" means the
// default schema) holds pgfence's objects at version Latest or newer. It returns a
// *NotMigratedError when it does not, and the database error when it cannot
// tell (for instance, the role may not read the schema).
func Verify(ctx context.Context, q pgexec.DB, schema string) error {
	if err := ident.ValidateSchema(schema); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	schema = ident.Schema(schema)
	st, err := Inspect(ctx, q, schema)
	if err != nil {
		return err
	}
	if !st.Exists || st.Current < Latest {
		return &NotMigratedError{Schema: schema, SchemaExists: st.Exists, Found: st.Current, Required: Latest}
	}
	return nil
}

// Epoch is a history of the database the token sequence issues in. The
// migration starts the first; each promotion, point-in-time recovery or
// restore into another cluster starts another, whose first token is the
// promoted server's clock (milliseconds since 2026-01-01 UTC) << 22, above
// every token of the histories before it (fence.Token).
type Epoch struct {
	// Timeline is the server timeline the history started on.
	Timeline int64 `json:"timeline"`
	// Started is the server's clock when it started.
	Started time.Time `json:"started"`
	// FirstToken is its first token: every token it issues is at least
	// this. In JSON a decimal string, like every token.
	FirstToken int64 `json:"first_token,string"`
}

// ReadEpoch reads the history schema issues tokens in. schema must be
// validated and not empty, and migrated (version 1 or newer).
func ReadEpoch(ctx context.Context, q pgexec.DB, schema string) (*Epoch, error) {
	e := &Epoch{}
	if err := q.QueryRow(ctx, epochSQL(schema)).Scan(&e.Timeline, &e.Started, &e.FirstToken); err != nil {
		return nil, fmt.Errorf("read the token epoch of schema %q: %w", schema, hint.Wrap(err, schema, hint.Role(q)))
	}
	return e, nil
}

package migrations

import "github.com/pgfence/pgfence/internal/ident"

// The package's own statements (the schema itself is in sql/*.sql).
const (
	sqlServerVersion = `SELECT current_setting('server_version_num')::int`
	sqlSchemaExists  = `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`
	// The migration lock: a transaction-level one while a schema is
	// created, a session-level one while goose migrates (the two conflict).
	sqlXactLock      = `SELECT pg_advisory_xact_lock($1)`
	sqlSessionLock   = `SELECT pg_advisory_lock($1)`
	sqlSessionUnlock = `SELECT pg_advisory_unlock($1)`
)

// syncEpochSQL moves the token sequence into the current history after a
// restore into another cluster (pgfence_sync_epoch); not on a standby.
func syncEpochSQL(schema string) string {
	return `SELECT NOT pg_is_in_recovery() AND ` + ident.Table(schema, "pgfence_sync_epoch") + `()`
}

// epochSQL reads the current token history.
func epochSQL(schema string) string {
	return `SELECT timeline, started_at, first_token FROM ` + ident.Table(schema, "pgfence_epoch")
}

package fence

import (
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/outcome"
)

// The package's SQL: the fences are functions in the schema (see the
// migrations); the statements only call them.

// idleBound sets idle_in_transaction_session_timeout for the rest of the
// transaction to $3 milliseconds (positive), unless the session's
// own setting is already that or shorter (and not 0). It costs no round
// trip of its own: it rides in the fence's statement. set_config(..., true)
// is SET LOCAL, so a pooled session (PgBouncer in transaction mode too)
// keeps its own setting. Setting it has a price on the server (on
// PostgreSQL 15 a transaction that changed a setting restores every
// setting at its end: BENCHMARKS.md), which a role whose sessions have the
// bound already does not pay.
const idleBound = `CASE WHEN coalesce(nullif(extract(epoch FROM ` +
	`current_setting('idle_in_transaction_session_timeout')::interval) * 1000, 0) > $3::bigint, true) ` +
	`THEN set_config('idle_in_transaction_session_timeout', $3::bigint::text, true) END`

// fenceSQL is a fence's statement: fn ($1, $2), pgfence_check or
// pgfence_admit in schema; with id, the transaction's id and the server's
// timeline and start (outcome.IDColumns), so that a COMMIT whose reply is
// lost can be looked up on another connection, for a transaction RunTx
// commits (the fence comes first: on a standby it fails before the
// timeline is read); with bound, the idle bound ($3). Each part is sent
// only where it is used: the bound's expression and the id's columns cost
// server time in every transaction (BENCHMARKS.md).
func fenceSQL(schema, fn string, id, bound bool) string {
	sql := "SELECT " + ident.Table(schema, fn) + "($1, $2)"
	if id {
		sql += outcome.IDColumns(schema)
	}
	if bound {
		sql += ", " + idleBound
	}
	return sql
}

// currentSQL reads a resource's high-water mark (0 if it has none).
func (r Resource) currentSQL() string {
	return "SELECT coalesce(max(token), 0) FROM " + ident.Table(r.Schema, "pgfence_fences") + " WHERE resource = $1"
}

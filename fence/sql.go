package fence

import (
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/outcome"
)

// The package's SQL: the fences are functions in the schema (see the
// migrations); the statements only call them.

// idleBound sets idle_in_transaction_session_timeout for the rest of the
// transaction to $3 milliseconds ($3 = 0: leave it), unless the session's
// own setting is already that or shorter (and not 0). It costs no round
// trip of its own: it rides in the fence's statement. set_config(..., true)
// is SET LOCAL, so a pooled session (PgBouncer in transaction mode too)
// keeps its own setting. Setting it has a price on the server (on
// PostgreSQL 15 a transaction that changed a setting restores every
// setting at its end: BENCHMARKS.md), which a role whose sessions have the
// bound already does not pay.
const idleBound = `CASE WHEN $3::bigint > 0 AND coalesce(nullif(extract(epoch FROM ` +
	`current_setting('idle_in_transaction_session_timeout')::interval) * 1000, 0) > $3::bigint, true) ` +
	`THEN set_config('idle_in_transaction_session_timeout', $3::bigint::text, true) END`

// checkSQL is the lease check of Guard.Check, with the idle bound.
func (g Guard) checkSQL() string {
	return "SELECT " + ident.Table(g.Schema, "pgfence_check") + "($1, $2), " + idleBound
}

// checkTxSQL is the check of a transaction RunTx runs: it also returns the
// transaction's id (the check's row lock has assigned one) and the server's
// timeline, so that a COMMIT whose reply is lost can be looked up on another
// connection (outcome.Resolve), and sets the idle bound. The check comes first: on a
// standby it fails before the timeline is read.
func (g Guard) checkTxSQL() string {
	return "SELECT " + ident.Table(g.Schema, "pgfence_check") + "($1, $2)" + outcome.IDColumns(g.Schema) + ", " + idleBound
}

// admitSQL raises a resource's high-water mark to a token, or refuses it,
// and sets the idle bound.
func (r Resource) admitSQL() string {
	return "SELECT " + ident.Table(r.Schema, "pgfence_admit") + "($1, $2), " + idleBound
}

// admitTxSQL is the admission of a transaction RunTx runs: as checkTxSQL,
// it also returns the transaction's id and the server's timeline.
func (r Resource) admitTxSQL() string {
	return "SELECT " + ident.Table(r.Schema, "pgfence_admit") + "($1, $2)" + outcome.IDColumns(r.Schema) + ", " + idleBound
}

// currentSQL reads a resource's high-water mark (0 if it has none).
func (r Resource) currentSQL() string {
	return "SELECT coalesce(max(token), 0) FROM " + ident.Table(r.Schema, "pgfence_fences") + " WHERE resource = $1"
}

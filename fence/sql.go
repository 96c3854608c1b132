package fence

import "github.com/pgfence/pgfence/internal/ident"

// The package's SQL: the fences are functions in the schema (see the
// migrations); the statements only call them.

// idleBound sets idle_in_transaction_session_timeout for the rest of the
// transaction to $3 milliseconds, or to the session's setting where that is
// shorter and not 0; $3 = 0 leaves it alone. It costs no round trip of its
// own: it rides in the fence's statement. set_config(..., true) is SET
// LOCAL, so a pooled session (PgBouncer in transaction mode too) keeps its
// own setting.
const idleBound = `CASE WHEN $3::bigint > 0 THEN set_config('idle_in_transaction_session_timeout', ` +
	`least(extract(epoch FROM nullif(current_setting('idle_in_transaction_session_timeout')::interval, '0')) * 1000, ` +
	`$3::bigint)::bigint::text, true) END`

// checkSQL is the lease check of Guard.Check, with the idle bound.
func (g Guard) checkSQL() string {
	return "SELECT " + ident.Table(g.Schema, "pgfence_check") + "($1, $2), " + idleBound
}

// checkTxSQL is the check of a transaction RunTx runs: it also returns the
// transaction's id (the check's row lock has assigned one) and the server's
// timeline, so that a COMMIT whose reply is lost can be looked up on another
// connection (resolve), and sets the idle bound. The check comes first: on a
// standby it fails before the timeline is read.
func (g Guard) checkTxSQL() string {
	return "SELECT " + ident.Table(g.Schema, "pgfence_check") + "($1, $2), pg_current_xact_id()::text, " +
		ident.Table(g.Schema, "pgfence_timeline") + "(), " + idleBound
}

// xactStatusSQL asks what became of a transaction (by its xid8, as text)
// and the server's timeline, for resolving a lost COMMIT reply.
func xactStatusSQL(schema string) string {
	return "SELECT pg_xact_status($1::xid8), " + ident.Table(schema, "pgfence_timeline") + "()"
}

// terminateXactSQL ends the backend that is still in the transaction $1
// (an xid8, as text), if any: pg_stat_activity shows the 32-bit xid, which
// no other running transaction can share.
const terminateXactSQL = `SELECT pg_terminate_backend(pid) FROM pg_stat_activity ` +
	`WHERE backend_xid::text::bigint = $1::text::bigint % 4294967296 AND pg_xact_status($1::xid8) = 'in progress'`

// admitSQL raises a resource's high-water mark to a token, or refuses it,
// and sets the idle bound.
func (r Resource) admitSQL() string {
	return "SELECT " + ident.Table(r.Schema, "pgfence_admit") + "($1, $2), " + idleBound
}

// admitTxSQL is the admission of a transaction RunTx runs: as checkTxSQL,
// it also returns the transaction's id and the server's timeline.
func (r Resource) admitTxSQL() string {
	return "SELECT " + ident.Table(r.Schema, "pgfence_admit") + "($1, $2), pg_current_xact_id()::text, " +
		ident.Table(r.Schema, "pgfence_timeline") + "(), " + idleBound
}

// currentSQL reads a resource's high-water mark (0 if it has none).
func (r Resource) currentSQL() string {
	return "SELECT coalesce(max(token), 0) FROM " + ident.Table(r.Schema, "pgfence_fences") + " WHERE resource = $1"
}

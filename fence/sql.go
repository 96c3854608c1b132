package fence

import "github.com/pgfence/pgfence/internal/ident"

// The package's SQL: the fences are functions in the schema (see the
// migrations); the statements only call them.

// checkSQL is the lease check of Guard.Check.
func (g Guard) checkSQL() string {
	return "SELECT " + ident.Table(g.Schema, "pgfence_check") + "($1, $2)"
}

// checkTxSQL is the check of a transaction RunTx runs: it also returns the
// transaction's id (the check's row lock has assigned one) and the server's
// timeline, so that a COMMIT whose reply is lost can be looked up on another
// connection (resolve). The check comes first: on a standby it fails before
// the timeline is read.
func (g Guard) checkTxSQL() string {
	return "SELECT " + ident.Table(g.Schema, "pgfence_check") + "($1, $2), pg_current_xact_id()::text, " +
		ident.Table(g.Schema, "pgfence_timeline") + "()"
}

// xactStatusSQL asks what became of a transaction (by its xid8, as text)
// and the server's timeline, for resolving a lost COMMIT reply.
func (g Guard) xactStatusSQL() string {
	return "SELECT pg_xact_status($1::xid8), " + ident.Table(g.Schema, "pgfence_timeline") + "()"
}

// admitSQL raises a resource's high-water mark to a token, or refuses it.
func (r Resource) admitSQL() string {
	return "SELECT " + ident.Table(r.Schema, "pgfence_admit") + "($1, $2)"
}

// currentSQL reads a resource's high-water mark (0 if it has none).
func (r Resource) currentSQL() string {
	return "SELECT coalesce(max(token), 0) FROM " + ident.Table(r.Schema, "pgfence_fences") + " WHERE resource = $1"
}

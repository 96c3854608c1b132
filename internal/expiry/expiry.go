// Package expiry is the one statement that makes the database judge a lease
// expired before its TTL, for tests and fault injection (pgfencetest.Expire,
// the chaos suite's clock faults).
package expiry

import "github.com/pgfence/pgfence/internal/ident"

// SQL returns the statement that expires lease $1 of schema now, as if its
// holder had paused past its TTL: the row names no session any more (it
// keeps its holder and secret, so the holder's next renewal reads it as
// expired, not freed), and the loss is counted on the session that held it,
// so that its client learns it at its next renewal. It changes no row of a
// lease that no session holds. Like a renewal once did, it neither waits
// for a guarded transaction (the row lock is FOR NO KEY UPDATE) nor makes
// the next ones wait.
func SQL(schema string) string {
	t, s := ident.Table(schema, "pgfence_leases"), ident.Table(schema, "pgfence_sessions")
	return `WITH old AS (SELECT name, session FROM ` + t + ` WHERE name = $1 AND session IS NOT NULL FOR NO KEY UPDATE),
lost AS (UPDATE ` + s + ` s SET losses = s.losses + 1 FROM old WHERE s.id = old.session)
UPDATE ` + t + ` l SET session = NULL, freed_at = now() - interval '1 microsecond' FROM old WHERE l.name = old.name`
}

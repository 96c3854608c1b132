package lock

import (
	"fmt"

	"github.com/pgfence/pgfence/internal/ident"
)

// Clock choice. Every statement here runs on its own (autocommit), so now()
// (the transaction start) is the statement start, at or after the moment the
// client sent the request. Setting expires_at = now() + TTL therefore never
// grants the holder more than TTL after its send time, which is what the local
// trust window assumes; and judging expiry with expires_at <= now() errs
// towards "still held" by the few microseconds the statement has run.
// Check uses clock_timestamp() because it may run inside a longer transaction,
// where now() could be seconds old and would wrongly call an expired lease held.

// queries holds the package's SQL, built once per client for its schema.
type queries struct {
	acquire, acquireNew, markWaiting, renew, release, check, inspect, forceRelease string
}

func newQueries(schema string) queries {
	t := ident.Table(schema, "pgfence_leases")
	return queries{
		// The compare-and-set, in one round trip: take the row if it is
		// free, released or expired (raising the token), and otherwise
		// return it as the statement's snapshot saw it, for HeldError.
		// Concurrent acquirers queue on the row lock and re-check the
		// WHERE on the newest version: exactly one wins. A plain UPDATE is
		// used rather than INSERT ... ON CONFLICT because it is markedly
		// cheaper for the server (see BENCHMARKS.md); the row is inserted
		// by acquireNew the first time a name is used.
		acquire: fmt.Sprintf(`WITH won AS (
    UPDATE %[1]s l
       SET token = l.token + 1, holder = $2, secret = $3, acquired_at = now(), renewed_at = now(),
           expires_at = now() + $4 * interval '1 microsecond'
     WHERE l.name = $1 AND (l.holder IS NULL OR l.expires_at <= now())
    RETURNING l.token, l.holder, l.expires_at)
SELECT true, token, holder, expires_at, (extract(epoch FROM expires_at - now()) * 1e6)::bigint FROM won
UNION ALL
SELECT false, c.token, coalesce(c.holder, ''), c.expires_at, (extract(epoch FROM c.expires_at - now()) * 1e6)::bigint
  FROM %[1]s c WHERE c.name = $1 AND NOT EXISTS (SELECT 1 FROM won)`, t),

		// First acquisition of a name; a concurrent first acquirer makes
		// this return no row, and the caller runs acquire again. No conflict
		// target: two first inserts collide on the primary key and on
		// UNIQUE (name, token), and only a target-less DO NOTHING absorbs a
		// collision on either (with "(name)" the other one is an error).
		acquireNew: fmt.Sprintf(`INSERT INTO %[1]s (name, token, holder, secret, acquired_at, renewed_at, expires_at)
VALUES ($1, 1, $2, $3, now(), now(), now() + $4 * interval '1 microsecond')
ON CONFLICT DO NOTHING
RETURNING true, token, holder, expires_at, (extract(epoch FROM expires_at - now()) * 1e6)::bigint`, t),

		// A blocked acquirer asks to be notified of the release. The
		// column is not a key, so this neither waits for nor blocks a
		// guarded transaction.
		markWaiting: fmt.Sprintf(`UPDATE %[1]s SET waiters_until = greatest(waiters_until, now() + $2 * interval '1 microsecond')
 WHERE name = $1 AND holder IS NOT NULL`, t),

		// All of a client's leases in one statement.
		renew: fmt.Sprintf(`UPDATE %[1]s l
   SET renewed_at = now(), expires_at = now() + $4 * interval '1 microsecond'
  FROM unnest($1::text[], $2::bigint[], $3::bytea[]) AS r(name, token, secret)
 WHERE l.name = r.name AND l.token = r.token AND l.secret = r.secret AND l.expires_at > now()
RETURNING l.name, l.token, l.expires_at`, t),

		release: fmt.Sprintf(`UPDATE %[1]s SET holder = NULL, secret = NULL, expires_at = least(expires_at, now())
 WHERE name = $1 AND token = $2 AND secret = $3`, t),

		check: fmt.Sprintf(`SELECT token, secret = $2 AND holder IS NOT NULL, expires_at > clock_timestamp(), expires_at
  FROM %[1]s WHERE name = $1`, t),

		inspect: fmt.Sprintf(`SELECT name, token, coalesce(holder, ''), holder IS NOT NULL AND expires_at > clock_timestamp(),
       acquired_at, renewed_at, expires_at, clock_timestamp()
  FROM %[1]s`, t),

		forceRelease: fmt.Sprintf(`WITH old AS (SELECT name, holder FROM %[1]s WHERE name = $1 FOR UPDATE)
UPDATE %[1]s l SET holder = NULL, secret = NULL, expires_at = least(l.expires_at, now())
  FROM old WHERE l.name = old.name
RETURNING l.token, coalesce(old.holder, '')`, t),
	}
}

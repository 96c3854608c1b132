package lock

import (
	"strings"
	"sync"

	"github.com/pgfence/pgfence/internal/ident"
)

// Clocks: every statement runs on its own, so now() is at or after the
// request's send time, from which the holder's trust window counts: an
// expiry of now() + TTL always outlasts it. Check may run inside a longer
// transaction, so it uses clock_timestamp().
//
// Lock order: the lease row, then the session row, in every statement that
// takes both; renewals take the session row alone, ForceRelease and
// revocations lease rows alone.

// queries is the package's SQL for one schema.
type queries struct {
	// A holder's session, acquisitions, checks and releases.
	startSession, renew, endSession, reconcile                                            string
	acquire, takeOver, heldBy, acquireNew, syncEpoch, check                               string
	release, releaseDurable, releaseMany, releaseManyDurable, releaseSecret, backendAlive string
	// Waiting for and watching a lease.
	pollWaited, observe string
	// The operators' reads, force-release and revocations.
	inspectAll, inspectOne, forceRelease, revoke string
}

// built holds each schema's statements (the operators' functions take a
// schema each call).
var built sync.Map // validated schema → *queries

// sqlFor returns schema's statements; schema must be validated.
func sqlFor(schema string) *queries {
	schema = ident.Schema(schema) // "" and "pgfence" are one schema
	if q, ok := built.Load(schema); ok {
		return q.(*queries)
	}
	q, _ := built.LoadOrStore(schema, newQueries(schema))
	return q.(*queries)
}

// Fragments of the statements below, whose {names} newQueries replaces
// with the schema's objects.
const (
	// wake is a RETURNING expression for statements that free lease l: it
	// notifies when a blocked acquirer asked for it (waiters_until).
	wake = `CASE WHEN l.waiters_until > now() THEN {wake_waiters}(l.name) ELSE false END`
	// free is the SET list of every statement that frees a lease row.
	free = `holder = NULL, secret = NULL, session = NULL, freed_at = now()`
	// ready is the epoch check (00001_leases.sql): the timeline functions
	// are inlined, so it reads no table unless the timeline changed.
	ready = `({timeline}() = {epoch_timeline}() OR {sync_epoch}())`
	// inspect is the operators' view of lease rows, without its WHERE.
	inspect = `SELECT name, token, coalesce(holder, ''), coalesce(holder IS NOT NULL AND expires_at > clock_timestamp(), false),
       acquired_at, renewed_at, coalesce(expires_at, acquired_at), clock_timestamp()
  FROM {states}`
	// lost records a loss for the sessions that held the rows of old,
	// without locking them: their next renewal counts it.
	lost = `lost AS (
  INSERT INTO {losses} (session, name, lost_at) SELECT old.session, old.name, now() FROM old WHERE old.session IS NOT NULL)`
	// Release commits asynchronously (Config.DurableRelease):
	// set_config(..., true) lasts until the statement's own transaction
	// commits, and in RETURNING it runs only if a row was released.
	async   = `, set_config('synchronous_commit', 'off', true)`
	release = `UPDATE {leases} l SET ` + free + `
 WHERE l.name = $1 AND l.token = $2 AND l.secret = $3
RETURNING ` + wake
	// Close's release of all the client's leases ($1 names, $2 tokens, $3
	// secrets), locked in name order as revoke locks them.
	releaseMany = `WITH mine AS (
  SELECT f.name FROM {leases} f JOIN unnest($1::text[], $2::bigint[], $3::bytea[]) AS r(name, token, secret)
    ON f.name = r.name AND f.token = r.token AND f.secret = r.secret
   ORDER BY f.name FOR NO KEY UPDATE OF f)
UPDATE {leases} l SET ` + free + ` FROM mine WHERE l.name = mine.name
RETURNING ` + wake
	// notifyObservers is acquire's and takeOver's RETURNING list: the
	// token, and a notification if an observer asked (observers_until).
	notifyObservers = `l.token, CASE WHEN l.observers_until > now() THEN {wake_waiters}(l.name) ELSE false END`
)

func newQueries(schema string) *queries {
	r := strings.NewReplacer(
		"{leases}", ident.Table(schema, "pgfence_leases"),
		"{sessions}", ident.Table(schema, "pgfence_sessions"),
		"{states}", ident.Table(schema, "pgfence_lease_states"),
		"{losses}", ident.Table(schema, "pgfence_session_losses"),
		"{timeline}", ident.Table(schema, "pgfence_timeline"),
		"{epoch_timeline}", ident.Table(schema, "pgfence_epoch_timeline"),
		"{sync_epoch}", ident.Table(schema, "pgfence_sync_epoch"),
		"{wake_waiters}", ident.Table(schema, "pgfence_wake_waiters"),
	).Replace
	return &queries{
		// A client's session ($1 holder, $2 TTL in µs).
		startSession: r(`INSERT INTO {sessions} (holder, started_at, renewed_at, expires_at)
VALUES ($1, now(), now(), now() + $2 * interval '1 microsecond')
RETURNING id, expires_at, {timeline}()`),

		// The renewal: one row, whatever the number of leases. A takeover
		// in flight counts its loss on this row, so the two serialise
		// there; an expired session stays expired. It returns the loss
		// count and the timeline (a promoted primary may lack the newest
		// acquisitions with no loss counted).
		renew: r(`UPDATE {sessions} SET renewed_at = now(), expires_at = now() + $2 * interval '1 microsecond'
 WHERE id = $1 AND expires_at > now()
RETURNING expires_at, losses + (SELECT count(*) FROM {losses} x WHERE x.session = $1), {timeline}()`),

		// Close: the session's leases are freed by then (releaseMany).
		endSession: r(`UPDATE {sessions} SET expires_at = least(expires_at, now()) WHERE id = $1`),

		// The leases among $1 names, $2 tokens, $3 secrets that session
		// $4 no longer holds, each row as check returns it.
		reconcile: r(`SELECT r.name, coalesce(l.token, 0), coalesce(l.secret = r.secret, false),
       coalesce(l.session = $4 AND s.expires_at > now(), false), coalesce(s.expires_at, l.freed_at, now())
  FROM unnest($1::text[], $2::bigint[], $3::bytea[]) AS r(name, token, secret)
  LEFT JOIN {leases} l ON l.name = r.name
  LEFT JOIN {sessions} s ON s.id = l.session
 WHERE (l.token = r.token AND l.secret = r.secret AND l.session = $4) IS NOT TRUE`),

		// The compare-and-set ($1 name, $2 holder, $3 secret, $4 the
		// acquirer's session) of a lease that names no session: the row
		// gets the token sequence's next value (DEFAULT of the identity
		// column) after the epoch check. Concurrent acquirers queue on the
		// row lock and re-check the newest version: exactly one wins.
		//
		// The explicit FOR UPDATE is the fence's other half: it conflicts
		// with the FOR KEY SHARE that pgfence_check holds for the rest of a
		// guarded transaction, so the acquisition waits for every guarded
		// transaction of the old token, and the update counts as a key
		// update, which guarded transactions that start meanwhile wait
		// for. Releases do not take it, so they never wait for one.
		//
		// An expired session's lease is taken by takeOver, kept out of
		// this statement so the common case costs nothing more (as one
		// statement, about 10% slower at 8 clients: BENCHMARKS.md).
		acquire: r(`UPDATE {leases} l SET token = DEFAULT, holder = $2, secret = $3, session = $4, acquired_at = clock_timestamp(), freed_at = NULL
 WHERE l.name = (SELECT f.name FROM {leases} f WHERE f.name = $1 AND f.session IS NULL FOR UPDATE)
   AND l.session IS NULL AND ` + ready + `
RETURNING ` + notifyObservers),

		// The takeover of lease $1 whose session expired (the arguments
		// as acquire's). A session newer than the statement's snapshot is
		// not seen expired, and not taken. taken counts the loss on the
		// session's row, which locks it: a renewal in flight is waited
		// for, and if it renewed the session nothing is taken.
		takeOver: r(`WITH locked AS (
  SELECT f.name, f.session FROM {leases} f
   WHERE f.name = $1 AND EXISTS (SELECT FROM {sessions} s WHERE s.id = f.session AND s.expires_at <= now())
   FOR UPDATE),
taken AS (
  UPDATE {sessions} s SET losses = s.losses + 1 FROM locked
   WHERE s.id = locked.session AND s.expires_at <= now() RETURNING s.id)
UPDATE {leases} l SET token = DEFAULT, holder = $2, secret = $3, session = $4, acquired_at = clock_timestamp(), freed_at = NULL
  FROM locked
 WHERE l.name = locked.name AND EXISTS (SELECT FROM taken) AND ` + ready + `
RETURNING ` + notifyObservers),

		// The row after a failed acquire (no row: the name's first
		// acquisition): whether it holds the caller's secret $2 (an
		// earlier attempt won and its reply was lost), and the session it
		// names (0: none).
		heldBy: r(`SELECT l.token, coalesce(l.holder, ''), coalesce(s.expires_at > now(), false),
       coalesce(s.expires_at, l.freed_at, now()),
       (extract(epoch FROM coalesce(s.expires_at, now()) - now()) * 1e6)::bigint, l.secret IS NOT DISTINCT FROM $2,
       coalesce(l.session, 0)
  FROM {leases} l LEFT JOIN {sessions} s ON s.id = l.session WHERE l.name = $1`),

		// A name's first acquisition (no row: another was first).
		acquireNew: r(`INSERT INTO {leases} (name, holder, secret, session, acquired_at)
SELECT $1, $2, $3, $4, now() WHERE ` + ready + `
ON CONFLICT DO NOTHING
RETURNING token`),

		// Once per client: move the token sequence into the current epoch
		// if the cluster changed under the schema (a logical restore),
		// which ready cannot see. False on a standby.
		syncEpoch: r(`SELECT NOT pg_is_in_recovery() AND {sync_epoch}()`),

		release:            r(release + async),
		releaseDurable:     r(release),
		releaseMany:        r(releaseMany + async),
		releaseManyDurable: r(releaseMany),

		// Frees an acquisition by the secret only it knew.
		releaseSecret: r(`UPDATE {leases} l SET ` + free + `
 WHERE l.name = $1 AND l.secret = $2
RETURNING ` + wake),

		// Whether backend $1 still exists.
		backendAlive: `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1::int8)`, // int8: a pooler's key may not fit int4

		// Lease $1 as its holder (secret $2, session $3) sees it.
		check: r(`SELECT l.token, coalesce(l.secret = $2, false), coalesce(l.session = $3 AND s.expires_at > clock_timestamp(), false),
       coalesce(s.expires_at, l.freed_at, clock_timestamp())
  FROM {leases} l LEFT JOIN {sessions} s ON s.id = l.session WHERE l.name = $1`),

		// The poller's statement for the leases $1 the client waits for:
		// it asks the held ones' releases to NOTIFY for the next $2
		// (rewriting a row only when less than $3 is left), and returns
		// each lease's state. waiters_until is not a key column: no guarded
		// transaction is waited for. SKIP LOCKED: waiting for several rows
		// in its own order could deadlock with a release of many.
		pollWaited: r(`WITH marked AS (
  UPDATE {leases} l SET waiters_until = greatest(l.waiters_until, now() + $2 * interval '1 microsecond')
    FROM (SELECT f.name FROM {leases} f
           WHERE f.name = ANY($1) AND EXISTS (SELECT FROM {sessions} s WHERE s.id = f.session AND s.expires_at > now())
             AND (f.waiters_until IS NULL OR f.waiters_until < now() + $3 * interval '1 microsecond')
           FOR NO KEY UPDATE OF f SKIP LOCKED) m
   WHERE l.name = m.name)
SELECT v.name, NOT coalesce(v.holder IS NOT NULL AND v.expires_at > now(), false),
       (extract(epoch FROM coalesce(v.expires_at, now()) - now()) * 1e6)::bigint
  FROM {states} v WHERE v.name = ANY($1)`),

		// An observer's statement for lease $1: pollWaited's marking for
		// acquisitions too, and inspectOne's row.
		observe: r(`WITH marked AS (
  UPDATE {leases} l SET observers_until = now() + $2 * interval '1 microsecond',
                     waiters_until = greatest(l.waiters_until, now() + $2 * interval '1 microsecond')
    FROM (SELECT f.name FROM {leases} f
           WHERE f.name = $1 AND (f.observers_until IS NULL OR f.observers_until < now() + $3 * interval '1 microsecond')
           FOR NO KEY UPDATE SKIP LOCKED) m
   WHERE l.name = m.name)
` + inspect + ` WHERE name = $1`),

		inspectAll: r(inspect + ` ORDER BY name`),
		inspectOne: r(inspect + ` WHERE name = $1`),

		forceRelease: r(`WITH old AS (SELECT name, holder, session FROM {leases} WHERE name = $1 FOR UPDATE),
` + lost + `
UPDATE {leases} l SET ` + free + `
  FROM old WHERE l.name = old.name
RETURNING l.token, coalesce(old.holder, ''), ` + wake),

		// Issues a new token to nobody for each of the leases $1
		// (RevokeTx), after the guarded transactions of the current one,
		// as acquire does; locked in name order (no deadlock with another
		// revocation or a Close).
		revoke: r(`WITH old AS (SELECT name, holder, session FROM {leases} WHERE name = ANY($1) ORDER BY name FOR UPDATE),
` + lost + `
UPDATE {leases} l SET token = DEFAULT, ` + free + `
  FROM old WHERE l.name = old.name AND ` + ready + `
RETURNING l.token, coalesce(old.holder, ''), ` + wake),
	}
}

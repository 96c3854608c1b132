package lock

import (
	"fmt"
	"sync"

	"github.com/pgfence/pgfence/internal/ident"
)

// Clock choice. Every statement here runs on its own (autocommit), so now()
// (the transaction start) is the statement start, at or after the moment the
// client sent the request. The local trust window counts from the send time
// of the session's last renewal, so any expiry at or after now() + TTL is
// safe: the holder stops trusting its leases before the database lets anyone
// else take them. Judging expiry with expires_at <= now() errs towards
// "still held" by the time the statement has run. Check uses
// clock_timestamp() because it may run inside a longer transaction, where
// now() could be seconds old and would wrongly call an expired lease held.
//
// Liveness lives in the session row (00005_sessions.sql): a lease is held
// while its row names a session that has not expired. Lock order: the lease
// row first, then the session row, in every statement that takes both (the
// takeover, and tests' expiry); renewals take the session row alone, and
// ForceRelease and revocations lease rows alone.

// queries is the package's SQL for one schema. It is built once per
// schema (sqlFor).
type queries struct {
	// A holder's session, acquisitions, checks and releases.
	startSession, renew, endSession, reconcile                                            string
	acquire, takeOver, heldBy, acquireNew, syncEpoch, check                               string
	release, releaseDurable, releaseMany, releaseManyDurable, releaseSecret, backendAlive string
	idleHolders, endBackend                                                               string
	// Waiting for and watching a lease.
	pollWaited, observe string
	// The operators' reads, force-release and revocations.
	inspectAll, inspectOne, forceRelease, revoke, revokeAll, blockers string
}

// built holds each schema's statements, built on first use: the
// operators' functions (Leases, Inspect, ForceRelease) take a schema each
// time.
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

// wakeWaiters is a RETURNING expression for statements that free a lease
// (alias l): it sends the release notification when a blocked acquirer asked
// for one (waiters_until), and says whether it did. It is evaluated only for
// rows the statement changed, and calls fn (pgfence_wake_waiters, which
// knows its schema) only when it notifies.
func wakeWaiters(fn string) string {
	return `CASE WHEN l.waiters_until > now() THEN ` + fn + `(l.name) ELSE false END`
}

// inspectSQL is the operators' view of lease rows (Leases, Inspect,
// Observe), without its WHERE.
func inspectSQL(v string) string {
	return fmt.Sprintf(`SELECT name, token, coalesce(holder, ''), coalesce(holder IS NOT NULL AND expires_at > clock_timestamp(), false),
       acquired_at, renewed_at, coalesce(expires_at, acquired_at), clock_timestamp()
  FROM %[1]s`, v)
}

// freeLease is the SET list of every statement that frees a lease row.
const freeLease = `holder = NULL, secret = NULL, session = NULL, freed_at = now()`

// readyCheck is the epoch check (00001_leases.sql): both timeline functions
// are inlined, so it reads no table; pgfence_sync_epoch runs only when they
// disagree (a new timeline). It cost about 9% of the statement as a read
// of the epoch row, more as a PL/pgSQL call (BENCHMARKS.md).
func readyCheck(schema string) string {
	return fmt.Sprintf(`(%s() = %s() OR %s())`, ident.Table(schema, "pgfence_timeline"),
		ident.Table(schema, "pgfence_epoch_timeline"), ident.Table(schema, "pgfence_sync_epoch"))
}

func newQueries(schema string) *queries {
	t := ident.Table(schema, "pgfence_leases")
	st := ident.Table(schema, "pgfence_sessions")
	v := ident.Table(schema, "pgfence_lease_states")
	wake := wakeWaiters(ident.Table(schema, "pgfence_wake_waiters"))
	inspect := inspectSQL(v)
	ready := readyCheck(schema)
	// Release commits without waiting for its WAL to reach disk
	// (synchronous_commit = off for this one transaction): see
	// Config.DurableRelease for why that is safe. set_config(..., true)
	// lasts until the end of the statement's own implicit transaction, so
	// it is in force when that transaction commits and gone after. It sits
	// in RETURNING, evaluated only for the rows released (a release that
	// matched nothing wrote nothing and has nothing to flush).
	const async = `, set_config('synchronous_commit', 'off', true)`
	release := fmt.Sprintf(`UPDATE %[1]s l SET %[3]s
 WHERE l.name = $1 AND l.token = $2 AND l.secret = $3
RETURNING %[2]s`, t, wake, freeLease)
	// Close's release of all the client's leases in one statement ($1
	// names, $2 tokens, $3 secrets), their rows locked in name order as
	// revokeAll locks them (FOR NO KEY UPDATE: like any release, it does
	// not wait for guarded transactions).
	releaseMany := fmt.Sprintf(`WITH mine AS (
  SELECT f.name FROM %[1]s f JOIN unnest($1::text[], $2::bigint[], $3::bytea[]) AS r(name, token, secret)
    ON f.name = r.name AND f.token = r.token AND f.secret = r.secret
   ORDER BY f.name FOR NO KEY UPDATE OF f)
UPDATE %[1]s l SET %[3]s FROM mine WHERE l.name = mine.name
RETURNING %[2]s`, t, wake, freeLease)
	// lost records a loss for the sessions that held the rows of old (its
	// columns session and name), without locking their rows: their
	// clients learn it at their next renewal after the commit.
	lost := fmt.Sprintf(`lost AS (
  INSERT INTO %[1]s (session, name, lost_at) SELECT old.session, old.name, now() FROM old WHERE old.session IS NOT NULL)`,
		ident.Table(schema, "pgfence_session_losses"))
	return &queries{
		// A client's session ($1 holder, $2 TTL in µs).
		startSession: fmt.Sprintf(`INSERT INTO %[1]s (holder, started_at, renewed_at, expires_at)
VALUES ($1, now(), now(), now() + $2 * interval '1 microsecond')
RETURNING id, expires_at, %[2]s()`, st, ident.Table(schema, "pgfence_timeline")),

		// The renewal: one row, whatever the number of leases. It waits
		// for a takeover in flight that counts a loss on the row (and
		// then returns the new count), and a takeover that comes after
		// it sees the session live. An expired session stays expired.
		// The count adds the losses ForceRelease and revocations recorded
		// (committed ones: those in flight are counted at a later renewal).
		// It returns the server's timeline too: after a promotion the new
		// primary may lack the newest acquisitions (asynchronous
		// replication), with no loss counted, so a new timeline makes the
		// client read all its leases again.
		renew: fmt.Sprintf(`UPDATE %[1]s SET renewed_at = now(), expires_at = now() + $2 * interval '1 microsecond'
 WHERE id = $1 AND expires_at > now()
RETURNING expires_at, losses + (SELECT count(*) FROM %[2]s x WHERE x.session = $1), %[3]s()`,
			st, ident.Table(schema, "pgfence_session_losses"), ident.Table(schema, "pgfence_timeline")),

		// Close: the session's leases are freed by then (releaseMany).
		endSession: fmt.Sprintf(`UPDATE %[1]s SET expires_at = least(expires_at, now()) WHERE id = $1`, st),

		// After a renewal that found the loss count changed: the leases
		// among $1 names, $2 tokens, $3 secrets that session $4 no longer
		// holds, with the row as it stands (as check returns it).
		reconcile: fmt.Sprintf(`SELECT r.name, coalesce(l.token, 0), coalesce(l.secret = r.secret, false),
       coalesce(l.session = $4 AND s.expires_at > now(), false), coalesce(s.expires_at, l.freed_at, now())
  FROM unnest($1::text[], $2::bigint[], $3::bytea[]) AS r(name, token, secret)
  LEFT JOIN %[1]s l ON l.name = r.name
  LEFT JOIN %[2]s s ON s.id = l.session
 WHERE (l.token = r.token AND l.secret = r.secret AND l.session = $4) IS NOT TRUE`, t, st),

		// The compare-and-set ($1 name, $2 holder, $3 secret, $4 the
		// acquirer's session) of a lease that names no session (released,
		// or never held): it locks the row FOR UPDATE if so, and gives it
		// a new token from the column's sequence (token is GENERATED
		// ALWAYS AS IDENTITY: DEFAULT is its nextval()), after the epoch
		// check (ready), which on the first acquisition after a promotion
		// moves the sequence into the new timeline's range
		// (00001_leases.sql). Concurrent acquirers queue on the row lock and
		// re-check the condition on the newest version: exactly one wins.
		//
		// The explicit FOR UPDATE is the fence's other half. pgfence_check
		// holds FOR KEY SHARE on the row for the rest of a guarded
		// transaction; FOR UPDATE conflicts with it, so the acquisition
		// waits until every guarded transaction that checked the old token
		// has ended, and PostgreSQL records the update made under it as a
		// key update, so guarded transactions that start meanwhile wait
		// for it and then see the new token. Releases update the row
		// without it, so they never wait for a guarded transaction, and
		// renewals do not touch it at all. Since token is not indexed, the
		// update is HOT.
		//
		// A lease whose session expired is taken by takeOver, sent when
		// heldBy (sent when this one wins nothing) finds the row so: kept
		// out of this statement, the session's table costs the common case
		// nothing (as one statement, the pair was about 10% slower at 8
		// clients: BENCHMARKS.md).
		acquire: fmt.Sprintf(`UPDATE %[1]s l SET token = DEFAULT, holder = $2, secret = $3, session = $4, acquired_at = clock_timestamp(), freed_at = NULL
 WHERE l.name = (SELECT f.name FROM %[1]s f WHERE f.name = $1 AND f.session IS NULL FOR UPDATE)
   AND l.session IS NULL AND %[3]s
RETURNING l.token, CASE WHEN l.observers_until > now() THEN %[4]s(l.name) ELSE false END`,
			t, st, ready, ident.Table(schema, "pgfence_wake_waiters")),

		// The takeover of lease $1 whose session expired (the arguments
		// as acquire's). locked locks the row FOR UPDATE if it names a
		// session this statement sees expired. Only a session row seen
		// expired counts: if a concurrent acquisition takes the row first,
		// the row is checked again in its new version, whose session may
		// be newer than this statement's snapshot (then it is not seen,
		// and not taken); session rows are never deleted
		// (00005_sessions.sql). taken counts the loss on the expired
		// session, which locks its row: a renewal in flight is waited for,
		// and if it renewed the session the row no longer matches, and
		// nothing is taken. Lease row first, then session row: the lock
		// order of every statement that takes both.
		takeOver: fmt.Sprintf(`WITH locked AS (
  SELECT f.name, f.session FROM %[1]s f
   WHERE f.name = $1 AND EXISTS (SELECT FROM %[2]s s WHERE s.id = f.session AND s.expires_at <= now())
   FOR UPDATE),
taken AS (
  UPDATE %[2]s s SET losses = s.losses + 1 FROM locked
   WHERE s.id = locked.session AND s.expires_at <= now() RETURNING s.id)
UPDATE %[1]s l SET token = DEFAULT, holder = $2, secret = $3, session = $4, acquired_at = clock_timestamp(), freed_at = NULL
  FROM locked
 WHERE l.name = locked.name AND EXISTS (SELECT FROM taken) AND %[3]s
RETURNING l.token, CASE WHEN l.observers_until > now() THEN %[4]s(l.name) ELSE false END`,
			t, st, ready, ident.Table(schema, "pgfence_wake_waiters")),

		// The sessions idle in a transaction for at least $2 µs that block
		// a statement waiting on the row of lease $1, if that lease is not
		// held: a holder frozen or cut off inside a guarded transaction
		// (idleholders.go). The waiting statement is found two ways. By
		// its backend, $3, holding a lock on the table (the row may have
		// moved since it began to wait: an update that leaves the key
		// alone does not wait for the holder, and the statement waits on
		// the version it found); behind PgBouncer the client does not
		// know its backend ($3 NULL), and only the other way is left: a
		// statement waiting on a row holds (or, behind another waiter,
		// waits for) the row's tuple lock, which pg_locks shows by page
		// and offset. pg_blocking_pids names what it waits for; of those,
		// only the transaction it waits on (a row lock's holder, not a
		// table lock's: an open migration). Another waiter is not idle,
		// so it is never returned; an aborted transaction has released its
		// locks. A blocking session whose state this role may not see
		// (another role's, without pg_read_all_stats) is returned with the
		// state '', to be reported, not ended. The transaction id and the
		// moment the session went idle pin what endBackend may end.
		idleHolders: fmt.Sprintf(`SELECT DISTINCT a.pid, coalesce(a.application_name, ''), coalesce(a.usename::text, ''), coalesce(a.state, ''),
       a.xact_start, left(coalesce(a.query, ''), 200), a.backend_xid::text, a.state_change
  FROM %[1]s l
  JOIN pg_locks w ON w.relation = l.tableoid
   AND w.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
   AND (w.locktype = 'relation' AND w.pid::int8 = $3::int8
        OR w.locktype = 'tuple' AND w.page = (l.ctid::text::point)[0]::int AND w.tuple = (l.ctid::text::point)[1]::int)
  JOIN pg_stat_activity a ON a.pid = ANY (pg_blocking_pids(w.pid))
 WHERE l.name = $1 AND (l.session IS NULL OR EXISTS (SELECT FROM %[2]s s WHERE s.id = l.session AND s.expires_at <= now()))
   AND (a.state IS NULL
        OR a.state = 'idle in transaction' AND a.state_change <= now() - $2 * interval '1 microsecond'
           AND EXISTS (SELECT 1 FROM pg_locks x WHERE x.pid = w.pid AND NOT x.granted
                          AND x.locktype = 'transactionid' AND x.transactionid = a.backend_xid))`, t, st),

		// Ends backend $1 if it is still idle in the transaction $2 that
		// idleHolders saw, since $3: not a transaction it has begun since
		// (behind PgBouncer, maybe another client's).
		endBackend: `SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a
 WHERE a.pid = $1 AND a.backend_xid::text = $2 AND a.state = 'idle in transaction' AND a.state_change = $3`,

		// The row after the acquire statement (no row: the name's first
		// acquisition): its token, holder, whether a live session holds
		// it, its expiry and the time to it, whether it holds the
		// caller's secret $2 (after a failed acquire, that means an earlier
		// attempt with the same secret won and its reply was lost), and
		// the session it names (0: none).
		heldBy: fmt.Sprintf(`SELECT l.token, coalesce(l.holder, ''), coalesce(s.expires_at > now(), false),
       coalesce(s.expires_at, l.freed_at, now()),
       (extract(epoch FROM coalesce(s.expires_at, now()) - now()) * 1e6)::bigint, l.secret IS NOT DISTINCT FROM $2,
       coalesce(l.session, 0)
  FROM %[1]s l LEFT JOIN %[2]s s ON s.id = l.session WHERE l.name = $1`, t, st),

		// First acquisition of a name; a concurrent first acquirer makes
		// this return no row, and the caller runs acquire again.
		acquireNew: fmt.Sprintf(`INSERT INTO %[1]s (name, holder, secret, session, acquired_at)
SELECT $1, $2, $3, $4, now() WHERE %[2]s
ON CONFLICT DO NOTHING
RETURNING token`, t, ready),

		// Once per client: move the token sequence into the current epoch
		// if the cluster changed under the schema (a logical restore into
		// another cluster), which the acquisitions' cheap check cannot see.
		// Not on a standby (false): acquisitions fail there anyway.
		syncEpoch: fmt.Sprintf(`SELECT NOT pg_is_in_recovery() AND %s()`, ident.Table(schema, "pgfence_sync_epoch")),

		release:            release + async,
		releaseDurable:     release,
		releaseMany:        releaseMany + async,
		releaseManyDurable: releaseMany,

		// Frees an acquisition whose outcome its client does not know
		// (the request was in flight when the caller gave up): the secret
		// is known only to that attempt.
		releaseSecret: fmt.Sprintf(`UPDATE %[1]s l SET %[3]s
 WHERE l.name = $1 AND l.secret = $2
RETURNING %[2]s`, t, wake, freeLease),

		// Whether backend $1 still exists.
		backendAlive: `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1::int8)`, // int8: a pooler's key may not fit int4

		// Lease $1 as its holder sees it: the token, whether the row
		// holds the acquisition's secret $2, whether session $3 holds it
		// and has not expired, and when it expires (or was freed).
		check: fmt.Sprintf(`SELECT l.token, coalesce(l.secret = $2, false), coalesce(l.session = $3 AND s.expires_at > clock_timestamp(), false),
       coalesce(s.expires_at, l.freed_at, clock_timestamp())
  FROM %[1]s l LEFT JOIN %[2]s s ON s.id = l.session WHERE l.name = $1`, t, st),

		// The poller's one statement per interval for every lease the
		// client's blocked Acquires wait for ($1): it asks the held ones'
		// releases to send a NOTIFY for the next $2 (rewriting a row only
		// when less than $3 is left, so about every other interval), and
		// returns each lease's state. waiters_until is not a key column, so
		// this neither waits for nor blocks a guarded transaction. Rows
		// locked by an acquisition or release in progress are skipped
		// (SKIP LOCKED): this statement locks several rows, and waiting
		// for them in its own order could deadlock with a release of many;
		// the next poll marks them.
		pollWaited: fmt.Sprintf(`WITH marked AS (
  UPDATE %[1]s l SET waiters_until = greatest(l.waiters_until, now() + $2 * interval '1 microsecond')
    FROM (SELECT f.name FROM %[1]s f
           WHERE f.name = ANY($1) AND EXISTS (SELECT FROM %[2]s s WHERE s.id = f.session AND s.expires_at > now())
             AND (f.waiters_until IS NULL OR f.waiters_until < now() + $3 * interval '1 microsecond')
           FOR NO KEY UPDATE OF f SKIP LOCKED) m
   WHERE l.name = m.name)
SELECT v.name, NOT coalesce(v.holder IS NOT NULL AND v.expires_at > now(), false),
       (extract(epoch FROM coalesce(v.expires_at, now()) - now()) * 1e6)::bigint
  FROM %[3]s v WHERE v.name = ANY($1)`, t, st, v),

		// An observer's one statement per interval for lease $1: it asks
		// the lease's next acquisitions and releases to send a NOTIFY for
		// the next $2
		// (rewriting the row only when less than $3 is left), skipping a
		// row locked by a statement in progress as pollWaited does, and
		// returns the lease's state as inspectOne does.
		observe: fmt.Sprintf(`WITH marked AS (
  UPDATE %[1]s l SET observers_until = now() + $2 * interval '1 microsecond',
                     waiters_until = greatest(l.waiters_until, now() + $2 * interval '1 microsecond')
    FROM (SELECT f.name FROM %[1]s f
           WHERE f.name = $1 AND (f.observers_until IS NULL OR f.observers_until < now() + $3 * interval '1 microsecond')
           FOR NO KEY UPDATE SKIP LOCKED) m
   WHERE l.name = m.name)
%[2]s WHERE name = $1`, t, inspect),

		// The sessions that block backend $1, for an operator whose
		// ForceRelease waits behind them.
		blockers: `SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.usename::text, ''), coalesce(a.state, ''),
       a.xact_start, left(coalesce(a.query, ''), 200)
  FROM pg_stat_activity a WHERE a.pid = ANY (pg_blocking_pids($1)) ORDER BY a.pid`,

		inspectAll: inspect + ` ORDER BY name`,
		inspectOne: inspect + ` WHERE name = $1`,

		forceRelease: fmt.Sprintf(`WITH old AS (SELECT name, holder, session FROM %[1]s WHERE name = $1 FOR UPDATE),
%[3]s
UPDATE %[1]s l SET %[4]s
  FROM old WHERE l.name = old.name
RETURNING l.token, coalesce(old.holder, ''), %[2]s`, t, wake, lost, freeLease),

		// Issues a new token for lease $1 to nobody (RevokeTx): the row
		// lock FOR UPDATE waits for the guarded transactions that checked
		// the current token, as an acquisition does (acquire),
		// and the epoch check runs before the sequence issues the token.
		revoke: fmt.Sprintf(`WITH old AS (SELECT name, holder, session FROM %[1]s WHERE name = $1 FOR UPDATE),
%[4]s
UPDATE %[1]s l SET token = DEFAULT, %[5]s
  FROM old WHERE l.name = old.name AND %[3]s
RETURNING l.token, coalesce(old.holder, ''), %[2]s`, t, wake, ready, lost, freeLease),

		// revoke for each of the leases $1 that exists, in one statement:
		// the rows are locked in name order (two revocations of
		// overlapping sets cannot deadlock, nor one and a Close, which
		// frees its leases in name order too).
		revokeAll: fmt.Sprintf(`WITH old AS (SELECT name, session FROM %[1]s WHERE name = ANY($1) ORDER BY name FOR UPDATE),
%[4]s
UPDATE %[1]s l SET token = DEFAULT, %[5]s
  FROM old WHERE l.name = old.name AND %[3]s
RETURNING l.name, %[2]s`, t, wake, ready, lost, freeLease),
	}
}

// listenSQL subscribes the listener's connection to the NOTIFY channel
// the leases table's trigger uses.
const listenSQL = "LISTEN pgfence_released"

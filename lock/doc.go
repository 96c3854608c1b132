// Package lock provides leases on PostgreSQL: named, expiring locks whose
// version column is also a fencing token, and leader election on top.
//
// # Model
//
// A lease is one row of pgfence_leases; a client's liveness is one row of
// pgfence_sessions, which every lease it holds names. A lease lives while
// its session has not expired by the database's clock. Acquiring is a
// compare-and-set that succeeds only if the row is free, released, or
// names an expired session (a takeover), and gives the row the next value
// of the token column's identity sequence. So:
//
//   - at most one client holds a lease at any moment by the database's clock;
//   - every acquisition returns a token strictly greater than every token
//     issued before, for any name in the table (a lease's tokens rise, but
//     not by one); renewals keep the token;
//     rows are never deleted and the schema refuses a token decrease, so
//     tokens never go back, not after release, crash or restart.
//
// A Client renews its session, and so all of its leases, with one
// statement of one row every RenewInterval, whatever their number;
// acquisitions never wait for it. A lease's context is cancelled the
// moment the lease is lost or can no longer be trusted: the holder trusts
// it until its session's last successful renewal (or start) was sent +
// TTL - SafetyMargin, on Go's monotonic clock, even if the database cannot
// be reached. A takeover counts the loss on the session's row (a renewal
// in flight serialises with it there), ForceRelease and revocations beside
// it; a renewal that sees the count move reads which
// leases were taken (one statement) before it extends the window, so a
// loss reaches its holder within one RenewInterval. Close frees every
// lease and ends the session at once. Release commits asynchronously
// (Config.DurableRelease says why that is safe).
//
// # What is not guaranteed
//
// A lease by itself cannot stop a paused holder from acting: a process frozen
// past its TTL wakes up with its context not yet cancelled, and may act before
// it notices. No timeout can tell "dead" from "frozen". Correctness comes from
// the fencing token, checked at the resource: use Lease.RunTx or
// Lease.Guard (package fence) for writes in PostgreSQL, or send Lease.Token to
// any other resource that refuses lower tokens. With asynchronous replication,
// a promoted standby may lack the newest acquisitions (their holders learn it
// at their next renewal); its tokens are still above theirs, since a new
// history of the database starts its tokens at the promoted server's clock
// (fence.Token), which assumes the servers' clocks agree to within the time
// a failover takes.
//
// # Waiting
//
// Acquire blocks until the lease is free. Releases are announced with
// NOTIFY on the channel pgfence_released when someone waits, so a waiter
// wakes within milliseconds; expiries, and rows freed by hand, are noticed
// by polling: one statement per PollInterval (jittered) for all the leases
// the client waits for, and one just after the soonest expiry. Election is
// the loop most programs want: campaign, lead with a context that is
// cancelled on loss, release, campaign again.
//
// # Errors: permanent or transient
//
// A client's first acquisition checks that its schema is migrated (a
// *migrations.NotMigratedError says what was found and what to run). After
// that, every database error is either permanent, and ends Acquire,
// Election.Run and runner.Runner.Run at once, or transient, and is retried
// with capped exponential backoff and jitter (PollInterval, doubling, up to
// 10 x PollInterval), logged once when the failures start and once when
// they stop:
//
//	error                                            SQLSTATE         class
//	connection refused, broken, closed; I/O error    (none), 08xxx    transient
//	connect failed on every host, one of them        (none)           transient
//	  transiently (timed out, refused, read only)
//	server clock behind the token history            PF013            transient
//	terminated by an administrator, server shutdown  57P01-57P03      transient
//	read-only transaction (a standby after failover) 25006            transient
//	serialization failure, deadlock                  40001, 40P01     transient
//	lock timeout, statement timeout                  55P03, 57014     transient
//	too many connections, out of resources           53xxx            transient
//	system error                                     58xxx            transient
//	schema missing or too old                        42P01, 42883     permanent
//	insufficient privilege                           42501            permanent
//	invalid data (e.g. a NUL byte)                   22xxx            permanent
//	authentication failed, no such database          28xxx, 3D000     permanent
//	pgfence's other refusals                         PFxxx            permanent
//	any other server error                           -                permanent
//
// Bad input never reaches the database (ErrInvalidName, *ConfigError).
// "No longer the holder" has one errors.Is target, fence.ErrFenced: it
// matches ErrLeaseLost as well as the fence package's refusals.
//
// # Deadlines
//
// Every call returns by its context's deadline whatever the network does
// (a partition that black-holes packets included), or within 500 ms of it
// (wait.PastDeadline) when it must tidy up: a release (Release, Close, an
// acquisition freeing what it cannot hand out) cut by the deadline or
// begun after it, an acquisition learning whether it ended a frozen
// holder's session, ForceRelease cancelling its statement.
// Work that must outlive the caller (freeing a lease; an acquisition in
// flight when its caller gave up, which the database may still grant, is
// freed by a secret only it knew) runs in the client's background within
// 5 s, and Close waits for it while its context allows. The client's own
// connections notice a black-holed server: renewals are bounded by the
// trust window, the listener pings after a TTL without a notification, the
// poller's statement is bounded by a TTL.
//
// # Observing
//
// Client.Observe reports who holds a lease, and each change within
// milliseconds; Inspect reads it once. The operators' functions (Leases,
// Inspect, ForceRelease, RevokeTx) take what they run on (a pool, a
// transaction) and a schema, and need no Client. Config.MeterProvider receives OpenTelemetry metrics (README's
// "Metrics"), Config.OnEvent the leases' events (Event), and the logger
// every loss and each start and end of a failure period.
package lock

// Package lock provides leases on PostgreSQL: named, expiring locks whose
// version column is also a fencing token, and leader election on top.
//
// # Model
//
// A lease is one row of pgfence_leases, and a client's liveness is one row
// of pgfence_sessions: every lease a client holds names its session, and
// lives while the session has not expired by the database's clock.
// Acquiring a lease is a compare-and-set that succeeds only if the row is
// free, released, or its session has expired (a takeover, which also locks
// the session's row and counts the loss there), and gives the row a new
// token: the next value of the token column's sequence (an
// identity column, which nothing else can write). So:
//
//   - at most one client holds a lease at any moment by the database's clock;
//   - every acquisition returns a token strictly greater than every token
//     issued before, for that name and for every other name in the same
//     table (tokens of one lease rise, but not by one); renewals keep the
//     token; the schema refuses a token decrease and rows are never
//     deleted, so tokens never go back, not after release, crash or restart.
//
// Release does not wait for its commit to reach disk (Config.DurableRelease
// says why that is safe and how to turn it off): a crash in the moment after
// a release can only leave the lease held until its expiry.
//
// A Client renews its session, and so all of its leases, in one statement
// of one row every RenewInterval, whatever their number; acquisitions never
// wait for it. Each Lease carries a context that is cancelled the moment the
// lease is lost (the session's renewal found it taken, freed or expired, or
// Check did) or can no longer be trusted: the holder trusts its leases only
// until the time its session's last successful renewal (or start) was sent
// + TTL - SafetyMargin, on Go's monotonic clock, and gives up then even if
// the database cannot be reached. A takeover after expiry counts the loss
// on the session's row in its own transaction (a renewal in flight and the
// takeover serialise there), ForceRelease and a revocation record theirs
// beside it without locking it, and a renewal returns the count: when it
// moved, the renewal reads which leases were taken (one statement) before
// it extends the window for the others, so the loss of one lease reaches
// its holder within one RenewInterval. Close frees every lease and ends the
// session at once.
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
// Acquire blocks until the lease is free. Releases (Lease.Release,
// ForceRelease) are announced with NOTIFY on the channel
// pgfence_released when someone waits, so a waiter wakes within
// milliseconds; leases that expire without release, or that an operator
// frees with a hand-written UPDATE, are noticed by polling: one statement
// per PollInterval (jittered) for every lease the client's Acquires wait
// for, however many, and one just after the soonest of their expiries.
//
// Election is the loop most programs want: campaign, lead with a context that
// is cancelled on loss, release, campaign again.
//
// # Errors: permanent or transient
//
// A client's first acquisition checks that its schema is migrated (a
// *migrations.NotMigratedError says what was found and what to run). After
// that, every database error is either permanent, and ends Acquire,
// Election.Run and runner.Runner.Run at once with that error, or transient,
// and is retried with capped exponential backoff and jitter (PollInterval,
// doubling, up to 10 x PollInterval), logged once when the failures start
// and once when they stop:
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
// Bad input never reaches the database: names, holders, schemas and
// durations are checked first (ErrInvalidName, *ConfigError).
//
// An acquisition in flight when its caller gives up (its context ends) may
// still be granted by the database: the client then frees that lease in the
// background, by a secret only that acquisition knew, once the server has
// finished the statement. Release still frees the lease when given a context
// that has already ended (in the background, within 5 s). ForceRelease waits
// for open guarded transactions only as long as its context allows, then
// returns a *BlockedError that names them.
//
// # Deadlines
//
// Every call returns by its context's deadline whatever the network does
// (a partition that black-holes packets included), or within 500 ms of it
// (wait.PastDeadline) when it must tidy up after it: Release and Close with
// a context that has already ended, ForceRelease cancelling its waiting
// statement. Work that must outlive the caller (freeing a lease, abandoning
// an acquisition whose answer was lost) runs in the client's background
// group within 5 s, and Close waits for it while its context allows. The
// client's own connections notice a black-holed server: renewals are
// bounded by the trust window, the release listener pings after a TTL
// without a notification and gives the connection up if the ping is not
// answered within a TTL, the poller's statement is bounded by a TTL.
//
// "No longer the holder" has one errors.Is target, fence.ErrFenced: it
// matches ErrLeaseLost as well as the fence package's refusals.
//
// # Observing
//
// Client.Observe tells a process that does not campaign who holds a lease,
// and each change within milliseconds (a notification on acquisition while
// someone observes, a read every PollInterval as the fallback);
// Inspect reads it once. The operators' functions (Leases, Inspect,
// ForceRelease) take a pool or any executor and a schema, and need no
// Client, as runner's do.
//
// Config.MeterProvider receives OpenTelemetry metrics (leases held,
// acquisitions by result, losses by cause, renewal latency, time left at
// renewal, clock skew, wait time; README's "Metrics" lists them):
// no-ops until an SDK is installed. Config.OnEvent receives Acquired,
// RenewedLate, Lost (with a LossCause) and Released events. The logger gets
// every loss, a warning when renewals or acquisitions start failing and a
// note when they recover (once per change), and a warning when the clock
// skew crosses Config.SkewWarning.
package lock

// Package fence makes writes safe against stale leaders: a write carries the
// fencing token of the lease under which it was made, and is refused, in the
// same transaction as the protected data, once a greater token exists.
//
// # Guarantees
//
// Guard (a lease guard, checked against the pgfence_leases table):
// a transaction in which Guard.Check (or Guard.Exec, or Guard.RunTx) succeeded
// commits only if, at commit, no token greater than the guard's token has been
// issued for the lease. The check takes a FOR KEY SHARE lock on the lease row.
// An acquisition locks the row FOR UPDATE before it raises the token, which
// conflicts with that lock: it waits until the guarded transaction ends, and
// a check that starts while an acquisition is in flight waits for it and then
// sees the new token. The holder's own renewals and releases take a weaker
// lock and do not wait. A refused transaction is aborted by the database: none
// of its statements commit, even if the caller tries.
//
// Tokens raised outside the library must follow the same rule: an UPDATE
// that sets token = DEFAULT without first locking the row FOR UPDATE does
// not wait for open guarded transactions, which may then still commit.
//
// Resource (a resource fence, kept next to the protected data in any
// database that has the pgfence migrations): Admit accepts a token only if it
// is >= the highest token the resource has admitted, and holds the fence row's
// lock until the transaction ends (Exec does the same, pipelined with the
// transaction's first statement). It writes the row only when the mark rises.
//
// Token-column pattern: for rows that carry their own token, write with
//
//	UPDATE accounts SET balance = $1, fence_token = $2
//	 WHERE id = $3 AND fence_token <= $2
//
// and treat zero rows affected as a stale write. Concurrent writers are
// ordered by the row lock.
//
// Resources outside PostgreSQL (object stores, HTTP APIs, other services)
// are protected only if they check the token themselves: send Token.String()
// with each request, have the resource remember the highest token it has
// accepted for the lease (atomically with the write, e.g. a conditional put),
// and refuse any request with a lower one.
//
// # What is not guaranteed
//
//   - A resource that does not check the token is not protected.
//   - A guarded transaction holds the lease row's KEY SHARE lock until it
//     ends: while it is open, a takeover waits. Once the lease has expired,
//     a lock client's takeover ends the session of a guarded transaction
//     that sits idle on the row (lock.Config.IdleHolderAfter), so a
//     holder frozen inside one is replaced about TTL + PollInterval after
//     it froze; Guard.IdleTimeout bounds it at the server instead, for
//     takers that wait. A single long statement is bounded only by
//     statement_timeout.
//   - With asynchronous replication, a standby promoted after a failover may
//     lack the newest acquisitions and guarded writes. Data in the same
//     database rolls back with them; effects outside the database do not.
//     Tokens issued after the promotion are above the lost ones (see Token),
//     so a resource fence refuses the lost holders from the new leader's
//     first write on. Synchronous replication loses nothing.
//   - Retryable tells which errors of a guarded transaction mean it did not
//     commit and may be run again (a failover's failed connects and
//     read-only errors among them).
//   - RunTx's answer is the truth about the commit: nil only if it
//     committed, ErrOutcomeUnknown only if the server cannot be asked
//     within its context (an *UnknownOutcomeError can ask again later), any
//     other error only if nothing of it committed. A COMMIT that fails
//     without the server's own ERROR or ROLLBACK (a connection reset right
//     after COMMIT was written, which pgx reports as "conn closed" and
//     calls safe to retry although the transaction committed; a terminated
//     session; a reply held past the deadline) is resolved by asking the
//     server on another connection (the transaction's id is read in the
//     first round trip): nil if it committed; if it did not, it is run
//     again like 40001, 40P01 and a connection lost before COMMIT was sent
//     (ErrNotCommitted if that keeps happening). A transaction whose
//     COMMIT you send yourself gets no such answer: use RunTx.
//
// # Errors
//
// ErrFenced is the one errors.Is target for "no longer the holder: stop":
// it matches *StaleTokenError, lock.ErrLeaseLost, runner.ErrFenced, and
// *SnapshotError (the check failed with 40001 because the transaction's
// REPEATABLE READ or SERIALIZABLE snapshot predates a takeover; RunTx runs
// such a transaction again, and the new snapshot reports the stale token).
//
// Statements sent through RunTx's transaction run under RunTx's context too,
// whatever context the function passes them: when it ends (for
// lock.Lease.RunTx, when the lease ends), the statement in flight is
// cancelled at the server, so it stops holding the lease row's lock.
package fence

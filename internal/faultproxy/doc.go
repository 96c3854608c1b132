// Package faultproxy is a small TCP proxy for fault injection in tests: it
// sits between clients and PostgreSQL and can pass traffic, delay it, drop it
// silently (blackhole, like a network partition) or reset every connection.
//
// It also injects faults at the COMMIT of a transaction, where a proxy, NAT
// or load balancer that drops or resets a connection hurts most (OnCommit):
// it reads the PostgreSQL frontend protocol from each client and, at a
// COMMIT, resets the client before or after forwarding it, after the
// server's reply, forwards it late, holds its reply or cuts the connection
// without a word to either side (CommitFault).
//
// What it recognises as a COMMIT: a simple Query whose whole text is COMMIT
// or END (any case, optional WORK or TRANSACTION, AND [NO] CHAIN, trailing
// semicolons and whitespace), which is how pgx's Tx.Commit sends it; and, in
// the extended protocol, the Execute of a portal bound to a statement
// (named or unnamed) parsed from such a text: the server commits when it
// executes it, before the Sync that follows. It does not see a COMMIT inside
// a multi-statement query or after a comment, COMMIT PREPARED, or a
// transaction that ends by any other means; and it stops reading a
// connection (passing its bytes through unchanged) once the server accepts
// an SSLRequest or GSSENCRequest, so commit faults need sslmode=disable.
// CommitsOn adds statements of the caller's choosing (autocommitted writes).
package faultproxy

package faultproxy

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// CommitFault is what the proxy does to a transaction's COMMIT (see OnCommit).
// Where a fault resets the client, the client sees an RST (SO_LINGER 0);
// where it closes the server side, the server sees an orderly close and
// rolls back a transaction still open.
type CommitFault int

const (
	// CommitPass forwards the COMMIT as usual.
	CommitPass CommitFault = iota
	// ResetAfterCommit forwards the COMMIT to the server, then at once resets
	// the client and closes the server side: whether the server committed is
	// a race, as in production (it usually does: the COMMIT arrives before
	// the close).
	ResetAfterCommit
	// ResetAfterReply forwards the COMMIT, waits for the server's reply (up
	// to the ReadyForQuery that ends it), discards that reply and resets the
	// client: the transaction committed (or the server refused it) and the
	// client never hears.
	ResetAfterReply
	// ResetBeforeCommit resets the client and closes the server side without
	// forwarding the COMMIT: the transaction does not commit.
	ResetBeforeCommit
	// LateCommit resets the client at once and forwards the COMMIT to the
	// server after the delay OnCommit's function returns, then closes the
	// server side after the server's reply (or after 10s without one): the
	// client has given up on a transaction that commits later.
	LateCommit
	// HoldReply forwards the COMMIT and holds the server's reply: nothing
	// more reaches the client (not even a close) until the client gives up
	// and closes its side; then the proxy closes the server side. Unlike the
	// HoldReplies mode it holds only this connection, from this COMMIT on.
	HoldReply
	// HalfOpen is a peer that vanished without a FIN: the COMMIT is not
	// forwarded and, from it on, nothing is forwarded in either direction.
	// The proxy closes neither side: the client's stays open until the
	// client closes it, the server's (its backend idle in transaction) until
	// the server closes it or Close.
	HalfOpen
)

// lateReplyWait bounds how long a LateCommit waits for the server's reply to
// the COMMIT it forwarded before it closes the server side.
const lateReplyWait = 10 * time.Second

var faultNames = [...]string{"CommitPass", "ResetAfterCommit", "ResetAfterReply", "ResetBeforeCommit",
	"LateCommit", "HoldReply", "HalfOpen"}

// String returns the fault's name.
func (f CommitFault) String() string {
	if f >= 0 && int(f) < len(faultNames) {
		return faultNames[f]
	}
	return fmt.Sprintf("CommitFault(%d)", int(f))
}

// OnCommit sets the function the proxy calls for every COMMIT a client sends
// (nil, the default: forward every COMMIT). It returns the fault to inject
// and, for LateCommit, the delay. The proxy calls it from its connections'
// goroutines, concurrently when several clients commit, without holding a
// lock (it may call the proxy's methods); it panics on a fault that is not
// one of the constants. A connection meets at most one fault: once its
// COMMIT's reply is held, its later COMMITs are forwarded without calling f.
func (p *Proxy) OnCommit(f func() (CommitFault, time.Duration)) {
	p.mu.Lock()
	p.onCommit = f
	p.mu.Unlock()
}

// CommitsOn makes the proxy treat, besides COMMIT, every statement whose
// text match accepts as a commit (nil, the default: none), so that
// OnCommit's faults (and Commits' counts) apply to an autocommitted write
// as to a COMMIT. A simple Query commits as it runs; an extended-protocol
// statement outside a transaction block only at the Sync after its
// Execute, which ResetAfterCommit does not forward: there it is a
// ResetBeforeCommit. Set it before clients connect.
func (p *Proxy) CommitsOn(match func(query string) bool) {
	p.mu.Lock()
	p.commitsOn = match
	p.mu.Unlock()
}

// Commits returns how many COMMITs (and statements CommitsOn names) met
// each fault so far (CommitPass included; faults none met are absent).
func (p *Proxy) Commits() map[CommitFault]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.commits)
}

// commitFault asks OnCommit's function what to do to a COMMIT, and counts it.
func (p *Proxy) commitFault() (CommitFault, time.Duration) {
	p.mu.Lock()
	f := p.onCommit
	p.mu.Unlock()
	fault, delay := CommitPass, time.Duration(0)
	if f != nil {
		fault, delay = f()
	}
	if fault < CommitPass || fault > HalfOpen {
		panic(fmt.Sprintf("faultproxy: OnCommit returned an unknown %v", fault))
	}
	p.mu.Lock()
	p.commits[fault]++
	p.mu.Unlock()
	return fault, max(delay, 0)
}

// isCommit reports whether a query's whole text commits the transaction:
// COMMIT or END, with an optional WORK or TRANSACTION and AND [NO] CHAIN.
func isCommit(query string) bool {
	w := strings.Fields(strings.ToLower(strings.TrimRight(query, "; \t\r\n\f\v")))
	if len(w) == 0 || w[0] != "commit" && w[0] != "end" {
		return false
	}
	w = w[1:]
	if len(w) > 0 && (w[0] == "work" || w[0] == "transaction") {
		w = w[1:]
	}
	return len(w) == 0 || slices.Equal(w, []string{"and", "chain"}) || slices.Equal(w, []string{"and", "no", "chain"})
}

// frontend follows a client's extended-protocol statements and portals far
// enough to tell which Execute runs a COMMIT. It keeps only the names that
// are COMMITs.
type frontend struct {
	stmts   map[string]bool
	portals map[string]bool
	also    func(query string) bool // CommitsOn's; nil: COMMITs only
}

// isCommit reports whether query commits: a COMMIT, or one CommitsOn names.
func (f *frontend) isCommit(query string) bool {
	return isCommit(query) || f.also != nil && f.also(query)
}

// commits reports whether the client message typ with body commits: a simple
// Query of a COMMIT, or the Execute of a portal bound to a statement parsed
// from one (the server commits as it executes it, before the Sync).
func (f *frontend) commits(typ byte, body []byte) bool {
	switch typ {
	case 'Q':
		q, _ := cstring(body)
		return f.isCommit(q)
	case 'P': // Parse: statement name, query, parameter types
		name, rest := cstring(body)
		q, _ := cstring(rest)
		mark(&f.stmts, name, f.isCommit(q))
	case 'B': // Bind: portal name, statement name, parameters
		portal, rest := cstring(body)
		stmt, _ := cstring(rest)
		mark(&f.portals, portal, f.stmts[stmt])
	case 'E': // Execute: portal name, row limit
		portal, _ := cstring(body)
		return f.portals[portal]
	case 'C': // Close: 'S' or 'P', name
		if len(body) > 0 {
			name, _ := cstring(body[1:])
			switch body[0] {
			case 'S':
				delete(f.stmts, name)
			case 'P':
				delete(f.portals, name)
			}
		}
	}
	return false
}

// inspected reports whether frontend.commits needs a client message of type
// typ whole (the others are streamed through).
func inspected(typ byte) bool { return strings.IndexByte("QPBEC", typ) >= 0 }

// mark records in *m whether name is a COMMIT (only those are kept).
func mark(m *map[string]bool, name string, commit bool) {
	if !commit {
		delete(*m, name)
		return
	}
	if *m == nil {
		*m = make(map[string]bool)
	}
	(*m)[name] = true
}

// cstring splits a NUL-terminated string off the front of b.
func cstring(b []byte) (string, []byte) {
	i := bytes.IndexByte(b, 0)
	if i < 0 {
		return string(b), nil
	}
	return string(b[:i]), b[i+1:]
}

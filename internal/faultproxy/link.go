package faultproxy

import (
	"bufio"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// Codes of the untyped messages a client may open a connection with, besides
// the startup message itself.
const (
	cancelRequest = 80877102
	sslRequest    = 80877103
	gssRequest    = 80877104
)

// maxStartup is the longest message that opens a connection the proxy
// parses (PostgreSQL's own limit is 10,000 bytes).
const maxStartup = 10000

// maxMessage is the longest message the proxy parses (PostgreSQL's own limit
// on a query is 1 GB); a longer length means it lost track, and it passes the
// rest of the connection through unparsed.
const maxMessage = 1 << 30

var (
	// errRaw stops a relay's parsing: the rest is passed through as is.
	errRaw = errors.New("faultproxy: stop parsing")
	// errTaken ends a relay whose connection a commit fault took over and
	// closed as the fault requires.
	errTaken = errors.New("faultproxy: taken over by a commit fault")
)

// link is one client connection and its server connection. Two goroutines
// relay it: requests (client to server) finds COMMITs and injects their
// faults; replies (server to client) counts ReadyForQuery messages, which
// tells it which messages answer the faulted COMMIT.
type link struct {
	p              *Proxy
	client, server net.Conn

	sent    int           // requests forwarded that the server ends with ReadyForQuery (requests' own)
	answer  chan byte     // the server's one-byte answer to an SSLRequest or GSSENCRequest
	replied chan struct{} // closed when a LateCommit's reply has arrived
	done    chan struct{} // closed when replies returns

	mu    sync.Mutex
	asked bool        // an SSLRequest or GSSENCRequest awaits its answer
	got   int         // ReadyForQuery messages received
	fault CommitFault // the fault this link met (CommitPass: none)
	watch int         // the ReadyForQuery (by count) that ends the faulted COMMIT's reply
	mute  bool        // forward nothing more to the client
}

func newLink(p *Proxy, client, server net.Conn) *link {
	return &link{p: p, client: client, server: server,
		answer: make(chan byte, 1), replied: make(chan struct{}), done: make(chan struct{})}
}

// requests relays the client's messages to the server. Either side ending
// ends both, unless a commit fault says otherwise.
func (l *link) requests() {
	r := newRelay(l.p, l.client, l.server, false)
	err := l.startup(r)
	if err == nil {
		err = l.messages(r)
	}
	if err == errRaw {
		err = r.copy(-1, false)
	}
	if err == errTaken {
		return
	}
	l.mu.Lock()
	hold := l.fault == HoldReply
	l.mu.Unlock()
	if hold && r.werr {
		// The server side is gone but its reply is held: the client hears
		// nothing, not even a close, until it gives up.
		_, _ = io.Copy(io.Discard, l.client)
	}
	_ = l.client.Close()
	_ = l.server.Close()
}

// startup relays the untyped messages that open a connection: an
// SSLRequest or GSSENCRequest the server refuses, then the startup message
// (nil: typed messages follow), or a CancelRequest, an encrypted connection
// or bytes that are not PostgreSQL's (errRaw).
func (l *link) startup(r *relay) error {
	for {
		var hdr [8]byte
		if err := r.pass(hdr[:], false); err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr[:4]))
		if n < len(hdr) || n > maxStartup {
			return errRaw
		}
		if err := r.copy(n-len(hdr), false); err != nil {
			return err
		}
		switch binary.BigEndian.Uint32(hdr[4:]) {
		case cancelRequest:
			return errRaw
		case sslRequest, gssRequest:
			// The request's last bytes are still in r.out (pass writes out
			// only before it waits), so the server cannot answer before
			// the flush below, and replies knows to expect the answer.
			l.mu.Lock()
			l.asked = true
			l.mu.Unlock()
			if err := r.flush(); err != nil {
				return err
			}
			select {
			case b := <-l.answer:
				if b != 'N' {
					return errRaw
				}
			case <-l.done:
				return net.ErrClosed
			}
		default:
			l.sent = 1 // the server ends the startup with a ReadyForQuery
			return nil
		}
	}
}

// messages relays typed messages, injecting OnCommit's fault at a COMMIT.
// It holds a message only while it needs it whole to tell whether it
// commits.
func (l *link) messages(r *relay) error {
	l.p.mu.Lock()
	f := frontend{also: l.p.commitsOn}
	l.p.mu.Unlock()
	for {
		typ, err := r.next()
		if err != nil {
			return err
		}
		var hdr [5]byte
		if !inspected(typ) {
			if err := r.pass(hdr[:], false); err != nil {
				return err
			}
			n := int(binary.BigEndian.Uint32(hdr[1:])) - 4
			if n < 0 || n > maxMessage {
				return errRaw
			}
			if err := r.copy(n, false); err != nil {
				return err
			}
		} else {
			if err := r.read(hdr[:]); err != nil {
				return err
			}
			n := int(binary.BigEndian.Uint32(hdr[1:])) - 4
			if n < 0 || n > maxMessage {
				if err := r.write(hdr[:]); err != nil {
					return err
				}
				return errRaw
			}
			msg := make([]byte, len(hdr)+n)
			copy(msg, hdr[:])
			if err := r.read(msg[len(hdr):]); err != nil {
				return err
			}
			l.mu.Lock()
			faulted := l.fault != CommitPass
			l.mu.Unlock()
			if f.commits(typ, msg[len(hdr):]) && !faulted {
				err = l.commit(r, typ, msg)
			} else {
				err = r.write(msg)
			}
			if err != nil {
				return err
			}
		}
		if typ == 'Q' || typ == 'S' || typ == 'F' { // Query, Sync, FunctionCall
			l.sent++
		}
	}
}

// commit injects the fault OnCommit's function chooses into the COMMIT
// message msg of type typ. It returns nil once it has forwarded msg and the
// relay goes on, or errTaken when the fault has taken the link over.
func (l *link) commit(r *relay, typ byte, msg []byte) error {
	fault, delay := l.p.commitFault()
	if fault == CommitPass {
		return r.write(msg)
	}
	l.mu.Lock()
	l.fault = fault
	l.watch = l.sent + 1 // msg's own ReadyForQuery, or its Sync's
	l.mute = fault == LateCommit || fault == HalfOpen
	l.mu.Unlock()
	switch fault {
	case ResetAfterReply, HoldReply: // replies takes it from here
		return r.write(msg)
	case ResetAfterCommit:
		if r.write(msg) == nil {
			_ = r.flush()
		}
		reset(l.client)
		_ = l.server.Close()
	case ResetBeforeCommit:
		_ = r.flush() // what came before the COMMIT
		reset(l.client)
		_ = l.server.Close()
	case LateCommit:
		_ = r.flush()
		reset(l.client)
		l.late(typ, msg, delay)
	case HalfOpen:
		_ = r.flush()
		_, _ = io.Copy(io.Discard, l.client) // until the client closes, or Close
		_ = l.client.Close()
	}
	return errTaken
}

// late forwards a LateCommit's COMMIT after delay, then closes the server
// side once the reply has come (or after lateReplyWait). It gives up when
// the server side ends first, Close included.
func (l *link) late(typ byte, msg []byte, delay time.Duration) {
	defer l.server.Close()
	t := time.NewTimer(delay)
	defer t.Stop()
	select {
	case <-t.C:
	case <-l.done:
		return
	}
	if typ == 'E' {
		// The client's Sync was never read: without one the server would
		// commit but not reply.
		msg = append(msg, 'S', 0, 0, 0, 4)
	}
	if _, err := l.server.Write(msg); err != nil {
		return
	}
	t.Reset(lateReplyWait)
	select {
	case <-l.replied:
	case <-l.done:
	case <-t.C:
	}
}

// replies relays the server's messages to the client, holding or dropping
// those that answer a faulted COMMIT.
func (l *link) replies() {
	defer close(l.done)
	r := newRelay(l.p, l.server, l.client, true)
	err := l.answers(r)
	if err == errRaw {
		err = r.copy(-1, false)
	}
	if err == errTaken {
		return
	}
	l.mu.Lock()
	fault := l.fault
	l.mu.Unlock()
	switch fault {
	case CommitPass:
		_ = l.client.Close()
		_ = l.server.Close()
	case ResetAfterCommit, ResetBeforeCommit: // requests closes both
	case ResetAfterReply: // the server side ended before the reply came
		reset(l.client)
		_ = l.server.Close()
	default: // LateCommit, HoldReply, HalfOpen: the client hears nothing
		_ = l.server.Close()
	}
}

// answers relays the server's answer to an SSLRequest or GSSENCRequest and
// its typed messages, and acts on the ReadyForQuery that ends a faulted
// COMMIT's reply.
func (l *link) answers(r *relay) error {
	for {
		typ, err := r.next()
		if err != nil {
			return err
		}
		l.mu.Lock()
		asked := l.asked
		l.asked = false
		l.mu.Unlock()
		if asked {
			_, _ = r.in.Discard(1)
			if err := r.write([]byte{typ}); err != nil {
				return err
			}
			l.answer <- typ
			if typ != 'N' {
				return errRaw
			}
			continue
		}
		l.mu.Lock()
		drop := l.mute || l.watch > 0 && l.got >= l.watch-1 // the faulted COMMIT's reply, or later
		end := false
		if typ == 'Z' {
			l.got++
			end = l.got == l.watch
		}
		fault := l.fault
		l.mu.Unlock()
		var hdr [5]byte
		if err := r.pass(hdr[:], drop); err != nil {
			return err
		}
		n := int(binary.BigEndian.Uint32(hdr[1:])) - 4
		if n < 0 || n > maxMessage {
			return errRaw
		}
		if err := r.copy(n, drop); err != nil {
			return err
		}
		if !end {
			continue
		}
		switch fault {
		case ResetAfterReply:
			_ = r.flush() // the replies that came before
			reset(l.client)
			_ = l.server.Close()
			return errTaken
		case LateCommit:
			close(l.replied)
		}
	}
}

// relay moves bytes from a source connection (read through the proxy's gate)
// to a destination, buffered both ways: it writes out what it has whenever
// it must wait for the source, so that bytes it forwards never wait in its
// buffer for others to arrive.
type relay struct {
	in   *bufio.Reader
	out  *bufio.Writer
	werr bool // a write failed: the destination is gone
}

func newRelay(p *Proxy, src, dst net.Conn, reply bool) *relay {
	return &relay{
		in:  bufio.NewReaderSize(gated{p: p, c: src, reply: reply}, 32<<10),
		out: bufio.NewWriterSize(dst, 32<<10),
	}
}

// wait waits until the source has a byte to read, writing out what is
// pending first.
func (r *relay) wait() error {
	if r.in.Buffered() > 0 {
		return nil
	}
	if err := r.flush(); err != nil {
		return err
	}
	_, err := r.in.Peek(1)
	return err
}

// next waits for the first byte of the next message and returns it, unread.
func (r *relay) next() (byte, error) {
	if err := r.wait(); err != nil {
		return 0, err
	}
	b, err := r.in.Peek(1)
	if err != nil {
		return 0, err
	}
	return b[0], nil
}

// read fills b from the source, holding those bytes back.
func (r *relay) read(b []byte) error {
	if r.in.Buffered() < len(b) {
		if err := r.flush(); err != nil {
			return err
		}
	}
	_, err := io.ReadFull(r.in, b)
	return err
}

// pass fills b from the source and forwards (or drops) its bytes as they
// come.
func (r *relay) pass(b []byte, drop bool) error {
	for len(b) > 0 {
		if err := r.wait(); err != nil {
			return err
		}
		k := copy(b, r.peekBuffered(len(b)))
		if !drop {
			if err := r.write(b[:k]); err != nil {
				return err
			}
		}
		_, _ = r.in.Discard(k)
		b = b[k:]
	}
	return nil
}

// peekBuffered returns up to n of the bytes buffered (all if n < 0), unread.
func (r *relay) peekBuffered(n int) []byte {
	k := r.in.Buffered()
	if n >= 0 {
		k = min(k, n)
	}
	b, _ := r.in.Peek(k)
	return b
}

// copy moves n bytes from the source to the destination (all of them until
// the source ends if n < 0), or reads and drops them.
func (r *relay) copy(n int, drop bool) error {
	for n != 0 {
		if err := r.wait(); err != nil {
			return err
		}
		b := r.peekBuffered(n)
		if !drop {
			if err := r.write(b); err != nil {
				return err
			}
		}
		_, _ = r.in.Discard(len(b))
		if n > 0 {
			n -= len(b)
		}
	}
	return nil
}

func (r *relay) write(b []byte) error {
	_, err := r.out.Write(b)
	r.werr = r.werr || err != nil
	return err
}

func (r *relay) flush() error {
	err := r.out.Flush()
	r.werr = r.werr || err != nil
	return err
}

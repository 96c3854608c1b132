package faultproxy

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

func TestIsCommit(t *testing.T) {
	t.Parallel()
	for q, want := range map[string]bool{
		"commit":                    true,
		"COMMIT":                    true,
		" Commit ; ":                true,
		"commit;;":                  true,
		"end":                       true,
		"END WORK;":                 true,
		"commit transaction":        true,
		"commit\n\twork":            true,
		"commit and chain":          true,
		"COMMIT AND NO CHAIN;":      true,
		"":                          false,
		";":                         false,
		"rollback":                  false,
		"commit prepared 'x'":       false,
		"commit; select 1":          false,
		"select 'commit'":           false,
		"committed":                 false,
		"commit work transaction":   false,
		"/* done */ commit":         false, // documented: not recognised
		"insert into t values (1)":  false,
		"ending":                    false,
		"end transaction and chain": true,
	} {
		if got := isCommit(q); got != want {
			t.Errorf("isCommit(%q) = %v, want %v", q, got, want)
		}
	}
}

// body joins NUL-terminated strings and raw byte strings into a message body.
func body(parts ...string) []byte {
	var b []byte
	for _, p := range parts {
		b = append(append(b, p...), 0)
	}
	return b
}

func TestFrontendCommits(t *testing.T) {
	t.Parallel()
	type msg struct {
		typ  byte
		body []byte
		want bool
	}
	bind := func(portal, stmt string) []byte { return append(body(portal, stmt), 0, 0, 0, 0, 0, 0) }
	exec := func(portal string) []byte { return append(body(portal), 0, 0, 0, 0) }
	for name, msgs := range map[string][]msg{
		"simple": {
			{'Q', body("select 1"), false},
			{'Q', body("COMMIT"), true},
		},
		"unnamed statement": { // pgconn.ExecParams
			{'P', body("", "commit", "\x00"), false},
			{'B', bind("", ""), false},
			{'D', body("P"), false},
			{'E', exec(""), true},
			{'S', nil, false},
			{'P', body("", "select 1", "\x00"), false},
			{'B', bind("", ""), false},
			{'E', exec(""), false}, // the unnamed statement was replaced
		},
		"named statement": { // pgconn.Prepare, then ExecPrepared
			{'P', body("fin", "end;", "\x00"), false},
			{'S', nil, false},
			{'P', body("", "select 1", "\x00"), false},
			{'B', bind("", "fin"), false},
			{'E', exec(""), true},
			{'B', bind("p1", ""), false},
			{'E', exec("p1"), false},
			{'B', bind("p2", "fin"), false},
			{'E', exec("p2"), true},
			{'C', body("Sfin"), false},
			{'B', bind("", "fin"), false}, // an error on the server: it no longer exists
			{'E', exec(""), false},
		},
		"autocommitted write (CommitsOn)": {
			{'Q', body("UPDATE t SET v = 1"), true},
			{'Q', body("select 1"), false},
			{'P', body("", "UPDATE t SET v = $1", "\x00"), false},
			{'B', bind("", ""), false},
			{'E', exec(""), true},
			{'Q', body("COMMIT"), true},
		},
		"closed portal": {
			{'P', body("", "commit", "\x00"), false},
			{'B', bind("p", ""), false},
			{'C', body("Pp"), false},
			{'E', exec("p"), false},
		},
	} {
		f := frontend{also: func(q string) bool { return strings.HasPrefix(q, "UPDATE") }}
		if !strings.Contains(name, "CommitsOn") {
			f.also = nil
		}
		for i, m := range msgs {
			if got := f.commits(m.typ, m.body); got != m.want {
				t.Errorf("%s: message %d (%c %q) commits = %v, want %v", name, i, m.typ, m.body, got, m.want)
			}
		}
	}
}

// message frames a typed frontend message.
func message(typ byte, body []byte) []byte {
	b := []byte{typ, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], uint32(4+len(body)))
	return append(b, body...)
}

// untyped frames a message that opens a connection: code and body.
func untyped(code uint32, body []byte) []byte {
	b := make([]byte, 8, 8+len(body))
	binary.BigEndian.PutUint32(b, uint32(8+len(body)))
	binary.BigEndian.PutUint32(b[4:], code)
	return append(b, body...)
}

var startupMessage = untyped(196608, body("user", "postgres", ""))

// fakeServer accepts one connection, answers an SSLRequest with answer if
// answer is not 0, and returns everything it received once the proxy closes
// its side.
func fakeServer(t *testing.T, answer byte) (string, <-chan []byte) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan []byte, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			got <- nil
			return
		}
		defer c.Close()
		var all []byte
		if answer != 0 {
			ssl := make([]byte, 8)
			if _, err := io.ReadFull(c, ssl); err != nil {
				got <- nil
				return
			}
			all = ssl
			_, _ = c.Write([]byte{answer})
		}
		rest, _ := io.ReadAll(c)
		got <- append(all, rest...)
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
	return ln.Addr().String(), got
}

// receive waits for what the fake server received.
func receive(t *testing.T, got <-chan []byte) []byte {
	t.Helper()
	select {
	case b := <-got:
		return b
	case <-time.After(10 * time.Second):
		t.Fatal("the server side was not closed within 10s")
		return nil
	}
}

// A COMMIT is found however the client's stream is cut into reads, and
// ResetBeforeCommit forwards exactly what came before it.
func TestCommitFraming(t *testing.T) {
	t.Parallel()
	before := append(append([]byte(nil), startupMessage...), message('Q', body("select 1"))...)
	before = append(before, message('d', bytes.Repeat([]byte("x"), 100<<10))...) // longer than a read: streamed
	stream := append(append([]byte(nil), before...), message('Q', body("COMMIT ;"))...)
	stream = append(stream, message('Q', body("select 2"))...)
	for _, chunk := range []int{1, 7, len(stream)} {
		addr, got := fakeServer(t, 0)
		p, err := New(addr)
		if err != nil {
			t.Fatal(err)
		}
		p.OnCommit(func() (CommitFault, time.Duration) { return ResetBeforeCommit, 0 })
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		for b := stream; len(b) > 0; b = b[min(chunk, len(b)):] {
			if _, err := c.Write(b[:min(chunk, len(b))]); err != nil {
				break // reset
			}
		}
		if b := receive(t, got); !bytes.Equal(b, before) {
			t.Errorf("chunks of %d: the server received %d bytes, want the %d before the COMMIT", chunk, len(b), len(before))
		}
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
			t.Errorf("chunks of %d: the client read %v, want a reset", chunk, err)
		}
		if n := p.Commits(); n[ResetBeforeCommit] != 1 || len(n) != 1 {
			t.Errorf("chunks of %d: Commits() = %v", chunk, n)
		}
		_ = c.Close()
		_ = p.Close()
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

// After an SSLRequest the server refuses, the startup message and the
// COMMIT are found; after one it accepts, the proxy passes bytes through.
func TestCommitAfterSSLRequest(t *testing.T) {
	t.Parallel()
	sslReq := untyped(sslRequest, nil)
	commit := message('Q', body("commit"))
	for _, answer := range []byte{'N', 'S'} {
		addr, got := fakeServer(t, answer)
		p, err := New(addr)
		if err != nil {
			t.Fatal(err)
		}
		p.OnCommit(func() (CommitFault, time.Duration) { return ResetBeforeCommit, 0 })
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write(sslReq); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 1)
		if _, err := io.ReadFull(c, b); err != nil || b[0] != answer {
			t.Fatalf("answer %q: the client read %q, %v", answer, b, err)
		}
		// With 'S' these bytes would be TLS: the proxy must not read them.
		if _, err := c.Write(append(append([]byte(nil), startupMessage...), commit...)); err != nil {
			t.Fatal(err)
		}
		want := append(append([]byte(nil), sslReq...), startupMessage...)
		if answer == 'S' {
			want = append(want, commit...)
			_ = c.Close() // the server side closes when the client's does
		}
		if b := receive(t, got); !bytes.Equal(b, want) {
			t.Errorf("answer %q: the server received %q, want %q", answer, b, want)
		}
		if n, want := p.Commits()[ResetBeforeCommit], map[byte]int{'N': 1, 'S': 0}[answer]; n != want {
			t.Errorf("answer %q: %d COMMITs reset, want %d", answer, n, want)
		}
		_ = c.Close()
		_ = p.Close()
	}
}

// HalfOpen closes neither side, and Close does not wait for them.
func TestHalfOpenClose(t *testing.T) {
	t.Parallel()
	addr, got := fakeServer(t, 0)
	p, err := New(addr)
	if err != nil {
		t.Fatal(err)
	}
	p.OnCommit(func() (CommitFault, time.Duration) { return HalfOpen, 0 })
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(append(append([]byte(nil), startupMessage...), message('Q', body("end"))...)); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); p.Commits()[HalfOpen] == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the COMMIT was not seen within 10s")
		}
	}
	if _, err := c.Write(message('Q', body("select 1"))); err != nil {
		t.Fatalf("the client side was closed: %v", err)
	}
	select {
	case b := <-got:
		t.Fatalf("the server side was closed, having received %q", b)
	default:
	}
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close hung on a half-open connection")
	}
	if b := receive(t, got); !bytes.Equal(b, startupMessage) {
		t.Errorf("the server received %q, want only the startup message", b)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Errorf("after Close the client read %v, want the connection closed", err)
	}
}

// Close stops a LateCommit whose COMMIT is still waiting to be forwarded.
func TestLateCommitStopsAtClose(t *testing.T) {
	t.Parallel()
	addr, got := fakeServer(t, 0)
	p, err := New(addr)
	if err != nil {
		t.Fatal(err)
	}
	p.OnCommit(func() (CommitFault, time.Duration) { return LateCommit, time.Hour })
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(append(append([]byte(nil), startupMessage...), message('Q', body("commit"))...)); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("the client read %v, want a reset", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close waited for a LateCommit's delay")
	}
	if b := receive(t, got); !bytes.Equal(b, startupMessage) {
		t.Errorf("the server received %q, want only the startup message", b)
	}
}

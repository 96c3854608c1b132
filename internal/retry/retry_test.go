package retry

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestTransient(t *testing.T) {
	pg := func(code string) error { return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: code}) }
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"terminated", pg("57P01"), true},
		{"read only after failover", pg("25006"), true},
		{"serialization", pg("40001"), true},
		{"deadlock", pg("40P01"), true},
		{"lock timeout", pg("55P03"), true},
		{"statement timeout", pg("57014"), true},
		{"too many connections", pg("53300"), true},
		{"connection failure", pg("08006"), true},
		{"io error", pg("58030"), true},
		{"undefined table", pg("42P01"), false},
		{"undefined function", pg("42883"), false},
		{"privileges", pg("42501"), false},
		{"bad byte sequence", pg("22021"), false},
		{"bad password", pg("28P01"), false},
		{"no database", pg("3D000"), false},
		{"pgfence refusal", pg("PF010"), false},
		{"eof", fmt.Errorf("read: %w", io.ErrUnexpectedEOF), true},
		{"canceled", context.Canceled, false},
		{"deadline", fmt.Errorf("x: %w", context.DeadlineExceeded), false},
		{"conn closed", fmt.Errorf("x: %w", pgconn.ErrConnClosed), true},
		{"clock behind the token history", pg("PF013"), true},
		{"plain", errors.New("something else"), false},
	}
	for _, c := range cases {
		if got := Transient(c.err); got != c.want {
			t.Errorf("%s: Transient(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
	if ConnectionLost(pg("40001")) || !ConnectionLost(pg("57P01")) || ConnectionLost(pg("42P01")) {
		t.Error("ConnectionLost classifies server errors wrongly")
	}
}

// A connect that fails on every host of a multi-host URL, as during a
// failover: one host hangs until connect_timeout (pgx reports
// context.DeadlineExceeded inside the *pgconn.ConnectError), another
// refuses. Transient, although it matches context.DeadlineExceeded.
func TestTransientFailedConnect(t *testing.T) {
	hung, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close() // accepts (the kernel's backlog) and never answers
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := closed.Addr().String()
	closed.Close()
	url := fmt.Sprintf("postgres://u@%s,%s/db?connect_timeout=1&sslmode=disable", hung.Addr(), refused)
	_, err = pgconn.Connect(context.Background(), url)
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("connect: %v, want a *pgconn.ConnectError that matches context.DeadlineExceeded", err)
	}
	if !Transient(err) {
		t.Errorf("Transient(%v) = false; a failover's failed connect must be retried", err)
	}
}

func TestBackoff(t *testing.T) {
	b := Backoff{Base: 100 * time.Millisecond, Max: time.Second}
	want := []time.Duration{100, 200, 400, 800, 1000, 1000}
	for n, w := range want {
		if got := b.Ceiling(n); got != w*time.Millisecond {
			t.Errorf("Ceiling(%d) = %v, want %v", n, got, w*time.Millisecond)
		}
		for range 100 {
			if got := b.Wait(n); got < b.Ceiling(n)/2 || got > b.Ceiling(n) {
				t.Fatalf("Wait(%d) = %v, outside [%v, %v]", n, got, b.Ceiling(n)/2, b.Ceiling(n))
			}
		}
	}
	if got := b.Ceiling(1 << 20); got != time.Second {
		t.Errorf("Ceiling of a huge attempt = %v, want the cap", got)
	}
}

// Spread keeps a fixed interval within ±25%, and varies it.
func TestSpread(t *testing.T) {
	const d = 100 * time.Millisecond
	seen := map[time.Duration]bool{}
	for range 1000 {
		got := Spread(d)
		if got < d*3/4 || got > d*5/4 {
			t.Fatalf("Spread(%v) = %v, outside ±25%%", d, got)
		}
		seen[got] = true
	}
	if len(seen) < 10 {
		t.Fatalf("Spread gave %d distinct values in 1000 calls", len(seen))
	}
	if Spread(0) != 0 || Spread(-time.Second) != -time.Second {
		t.Fatal("Spread of a non-positive interval changed it")
	}
}

// A failure period is logged once: a warning at its first failure, debug
// for the repeats, one note when it ends; a success outside a period logs
// nothing.
func TestFailingLogsOncePerPeriod(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	var f Failing
	f.Recover(log, "recovered")
	for range 3 {
		f.Fail(log, "failing", errors.New("boom"))
	}
	if f.Count() != 3 {
		t.Fatalf("Count = %d, want 3", f.Count())
	}
	f.Recover(log, "recovered")
	f.Recover(log, "recovered")
	out := buf.String()
	if strings.Count(out, "level=WARN") != 1 || strings.Count(out, "level=DEBUG") != 2 ||
		strings.Count(out, "level=INFO") != 1 || !strings.Contains(out, "failures=3") || f.Count() != 0 {
		t.Fatalf("log:\n%s", out)
	}
}

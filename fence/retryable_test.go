package fence_test

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// Which guarded-transaction errors a caller may retry as a whole: what a
// failover shows (a connect refused or timed out on every host, a read-only
// server, a session terminated before COMMIT, as RunTx reports it) yes; an
// unknown outcome, a fenced writer, a permanent error, and a broken
// connection or a FATAL that nothing has judged (either can follow a COMMIT
// that went through) no.
func TestRetryable(t *testing.T) {
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := closed.Addr().String()
	closed.Close()
	_, refused := pgconn.Connect(context.Background(), "postgres://u@"+addr+","+addr+"/db?sslmode=disable&connect_timeout=1")
	// The test server, asked for a database it does not have: 3D000 on
	// every host tried is permanent; after a host that refused (which may
	// be the primary once it is back), transient. pgx stops at a server's
	// error, so the refusing host goes first.
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/pgfence_no_such_database"
	_, noDB := pgconn.Connect(context.Background(), u.String())
	server := u.Host
	if u.Port() == "" {
		server += ":5432"
	}
	u.Host = addr + "," + server
	_, noDBOrRefused := pgconn.Connect(context.Background(), u.String())
	pg := func(code string) error { return fmt.Errorf("guarded: %w", &pgconn.PgError{Code: code}) }
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"connect refused on every host", refused, true},
		{"no such database (3D000) on the only host", noDB, false},
		{"refused on one host, no such database on the next", noDBOrRefused, true},
		{"read only (a standby after failover)", pg("25006"), true},
		{"session terminated before COMMIT (RunTx's word)", fmt.Errorf("%w: %w", fence.ErrNotCommitted,
			&pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: "57P01"}), true},
		{"session terminated, unjudged (may follow a commit)", fmt.Errorf("commit: %w",
			&pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: "57P01"}), false},
		{"connection closed, unjudged (pgx: safe to retry; the COMMIT went through)", fmt.Errorf("commit: %w", pgconn.ErrConnClosed), false},
		{"a COMMIT the server reports aborted", fmt.Errorf("%w: conn closed", fence.ErrNotCommitted), true},
		{"serialization failure", pg("40001"), true},
		{"outcome unknown", fmt.Errorf("%w: %w", fence.ErrOutcomeUnknown, pg("08006")), false},
		{"stale token", &fence.StaleTokenError{Lease: "x", Presented: 1, Current: 2}, false},
		{"missing table", pg("42P01"), false},
		{"nil", nil, false},
	}
	for _, c := range cases {
		if got := fence.Retryable(c.err); got != c.want {
			t.Errorf("%s: Retryable(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}

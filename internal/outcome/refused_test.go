package outcome

import (
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A failed COMMIT is taken as certainly not committed only when the server
// itself refused it with an ERROR or answered ROLLBACK; a FATAL (a
// terminated session), a broken or closed connection, and what pgx calls
// safe to retry are looked up on the server.
func TestRefusedCommits(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"serialization failure at commit", &pgconn.PgError{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "40001"}, true},
		{"deferred constraint", &pgconn.PgError{Severity: "ERROR", SeverityUnlocalized: "ERROR", Code: "23505"}, true},
		{"answered ROLLBACK", pgx.ErrTxCommitRollback, true},
		{"session terminated (may follow the commit)", &pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: "57P01"}, false},
		{"FATAL, localized severity only", &pgconn.PgError{Severity: "FATAL", Code: "57P01"}, false},
		{"server crash", &pgconn.PgError{Severity: "PANIC", SeverityUnlocalized: "PANIC", Code: "XX000"}, false},
		{"connection broken mid-flight", fmt.Errorf("commit: %w", io.ErrUnexpectedEOF), false},
		{"wrapped FATAL", fmt.Errorf("x: %w", &pgconn.PgError{SeverityUnlocalized: "FATAL", Code: "57P01"}), false},
		{"some other error", errors.New("boom"), false},
		// What pgx v5 returns when the connection is reset right after
		// COMMIT reached the server: the transaction committed.
		{"connection closed after COMMIT was written (pgx: safe to retry)", fmt.Errorf("commit: %w", pgconn.ErrConnClosed), false},
	} {
		if got := Refused(tc.err); got != tc.want {
			t.Errorf("%s: Refused(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}

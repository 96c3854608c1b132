package errtype

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestOf(t *testing.T) {
	pgErr := &pgconn.PgError{Code: "40001", Message: "could not serialize access"}
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"a server refusal gives its SQLSTATE", fmt.Errorf("lock: acquire: %w", pgErr), "40001"},
		{"the server's answer wins over the context", errors.Join(context.DeadlineExceeded, pgErr), "40001"},
		{"a malformed code is not a SQLSTATE", &pgconn.PgError{Code: "4"}, Other},
		{"a deadline", fmt.Errorf("wrapped: %w", context.DeadlineExceeded), Timeout},
		{"a cancellation", context.Canceled, Canceled},
		{"a broken connection", io.ErrUnexpectedEOF, Connection},
		{"a network error", &net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}, Connection},
		{"anything else", errors.New("the payment provider is down"), Other},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Of(tc.err); got != tc.want {
				t.Errorf("Of(%v) = %q, want %q", tc.err, got, tc.want)
			}
			if got := Attr(tc.err); string(got.Key) != "error.type" || got.Value.AsString() != tc.want {
				t.Errorf("Attr(%v) = %v", tc.err, got)
			}
		})
	}
}

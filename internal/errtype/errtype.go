// Package errtype gives an error the low-cardinality identifier that
// OpenTelemetry's semantic conventions put in the error.type attribute.
package errtype

import (
	"context"
	"errors"
	"io"
	"net"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel/attribute"
)

// Key is the semantic conventions' attribute key.
const Key = attribute.Key("error.type")

// Values other than a SQLSTATE.
const (
	Timeout    = "timeout"    // the caller's deadline passed
	Canceled   = "canceled"   // the caller's context was cancelled
	Connection = "connection" // the connection broke or could not be made
	Other      = "_OTHER"     // the conventions' fallback
)

// Of names err's kind: the server's SQLSTATE (five characters: a bounded
// set) when the server refused, Timeout, Canceled, Connection, or Other.
// The server's answer wins over a context that ended meanwhile.
func Of(err error) string {
	var pg *pgconn.PgError
	var ce *pgconn.ConnectError
	var ne net.Error
	switch {
	case errors.As(err, &pg) && len(pg.Code) == 5:
		return pg.Code
	case errors.Is(err, context.DeadlineExceeded):
		return Timeout
	case errors.Is(err, context.Canceled):
		return Canceled
	case errors.As(err, &ce), errors.As(err, &ne), errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, net.ErrClosed):
		return Connection
	}
	return Other
}

// Attr is err's error.type attribute.
func Attr(err error) attribute.KeyValue { return Key.String(Of(err)) }

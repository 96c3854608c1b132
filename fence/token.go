package fence

import (
	"fmt"
	"strconv"
)

// Token is a fencing token: the version of a lease at the moment it was
// acquired. Every acquisition of a lease gets a token strictly greater than
// every token issued before it for that lease, so a resource that remembers the
// highest token it has seen can refuse a holder whose lease has moved on.
// Valid tokens are >= 1. Compare tokens as plain numbers.
//
// One sequence issues the tokens of every lease in a schema: 1, 2, 3... on a
// database that never failed over. A new history of the database (a
// promotion, a point-in-time recovery, a logical restore into another
// cluster) starts at the promoted server's clock, ms << 22 where ms counts
// milliseconds since 2026-01-01 UTC, and counts on by one from there, so
// every token issued after a failover is above every token the old primary
// issued, even those that asynchronous replication lost. README's "Running
// on HA PostgreSQL" says what that assumes of the servers' clocks.
type Token int64

// String returns the token in decimal, the form to send to a resource outside
// PostgreSQL (a header, an object's metadata, a conditional request).
func (t Token) String() string { return strconv.FormatInt(int64(t), 10) }

// Valid reports whether t could have been issued (t >= 1).
func (t Token) Valid() bool { return t >= 1 }

// MarshalText implements encoding.TextMarshaler (decimal).
func (t Token) MarshalText() ([]byte, error) { return []byte(t.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler; it accepts exactly
// what ParseToken accepts.
func (t *Token) UnmarshalText(b []byte) error {
	v, err := ParseToken(string(b))
	if err != nil {
		return err
	}
	*t = v
	return nil
}

// ParseToken parses a decimal token as written by Token.String: an issued
// token (1 and up), or "0", the zero value ("no token": a job without a
// leader, an offset never committed), which String writes too (check
// Valid where only an issued token will do). It returns an error wrapping
// ErrInvalidToken for anything else: a negative number, or text that is
// not a decimal integer.
func ParseToken(s string) (Token, error) {
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: %q is not a decimal integer", ErrInvalidToken, s)
	}
	if v < 0 {
		return 0, fmt.Errorf("%w: %d is negative (tokens start at 1; 0 is no token)", ErrInvalidToken, v)
	}
	return Token(v), nil
}

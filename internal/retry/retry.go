// Package retry classifies database errors as transient or permanent and
// computes capped exponential backoff with jitter. It is pure logic: the
// packages that loop (lock, runner) decide what to do with its answers.
package retry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Transient reports whether err is worth retrying: the same request can
// succeed later without anyone changing configuration or schema. The
// classification (documented as a table in package lock) is:
//
//   - transient: a connection that could not be made, broke or was closed
//     (network errors, io.EOF, SQLSTATE class 08), the server shutting down
//     or terminating the session (57P01, 57P02, 57P03), a read-only server
//     (25006, a standby after failover), serialization failures and
//     deadlocks (40001, 40P01), lock and statement timeouts (55P03, 57014),
//     insufficient resources (class 53, e.g. 53300 too many connections),
//     system errors (class 58), and a server whose clock is behind the token
//     history (PF013: it goes away as the clock moves on);
//   - a failed connect (*pgconn.ConnectError) is transient if any of its
//     hosts failed transiently: during a failover one host times out
//     (connect_timeout, which pgx reports as context.DeadlineExceeded),
//     another refuses, a third is read only (target_session_attrs), and all
//     of that passes once a primary is up; it is permanent only when every
//     host gave a permanent answer (failed authentication, an unknown
//     database, a TLS certificate that does not verify);
//   - permanent: every other server error, e.g. a missing table or function
//     (42P01, 42883: the schema is missing or old), missing privileges
//     (42501), invalid data (class 22), failed authentication (class 28), an
//     unknown database (3D000), and pgfence's own refusals (PF...).
//
// Context cancellation outside a connect attempt is neither: callers check
// their own context first.
func Transient(err error) bool {
	if err == nil {
		return false
	}
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		return connectTransient(ce.Unwrap())
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return transientCode(pg.Code)
	}
	// Not a server error: the request never got an answer.
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) || pgconn.SafeToRetry(err) ||
		errors.Is(err, pgconn.ErrConnClosed)
}

// connectTransient classifies the per-host errors of a failed connect
// (pgconn joins them): transient if any host may answer later.
func connectTransient(err error) bool {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range j.Unwrap() {
			if connectTransient(e) {
				return true
			}
		}
		return false
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return transientCode(pg.Code)
	}
	var (
		unknownAuthority x509.UnknownAuthorityError
		hostname         x509.HostnameError
		invalid          x509.CertificateInvalidError
		verify           *tls.CertificateVerificationError
	)
	if errors.As(err, &unknownAuthority) || errors.As(err, &hostname) || errors.As(err, &invalid) || errors.As(err, &verify) {
		return false
	}
	// A timeout, a refused or reset connection, a server that is starting
	// up or read only, a name that did not resolve: a failover's errors.
	return err != nil
}

// transientCode classifies a SQLSTATE.
func transientCode(code string) bool {
	switch code {
	case "25006", "40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03", "PF013":
		return true
	}
	if len(code) == 5 {
		switch code[:2] {
		case "08", "53", "58":
			return true
		}
	}
	return false
}

// ConnectionLost reports whether err says the session ended (the server
// terminated it, also for sitting idle in a transaction past
// idle_in_transaction_session_timeout, 25P03; or the connection broke):
// whatever the statement was, its transaction did not and will not commit,
// unless the statement was COMMIT.
func ConnectionLost(err error) bool {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code == "57P01" || pg.Code == "57P02" || pg.Code == "57P03" || pg.Code == "25P03" ||
			(len(pg.Code) == 5 && pg.Code[:2] == "08")
	}
	return Transient(err)
}

// Backoff is capped exponential backoff with jitter: the n-th wait (from 0)
// is drawn from [d/2, d] where d = min(Base * 2^n, Max). Equal jitter keeps a
// floor (a retry never comes at once) while spreading many clients that failed
// together.
type Backoff struct {
	// Base is the first wait's upper bound. Must be positive.
	Base time.Duration
	// Max caps every wait. Must be >= Base.
	Max time.Duration
}

// Ceiling returns the upper bound of the n-th wait, without jitter.
func (b Backoff) Ceiling(n int) time.Duration {
	d := b.Base
	for i := 0; i < n && d < b.Max; i++ {
		d *= 2
	}
	return min(d, b.Max)
}

// Spread returns d spread by ±25%, for a fixed interval that many clients
// keep (polling), so that they do not act in lockstep.
func Spread(d time.Duration) time.Duration {
	if d <= 0 {
		return d
	}
	return d*3/4 + time.Duration(rand.Int64N(int64(d)/2+1))
}

// Wait returns the n-th wait, jittered.
func (b Backoff) Wait(n int) time.Duration {
	d := b.Ceiling(n)
	if d <= 1 {
		return d
	}
	return d/2 + time.Duration(rand.Int64N(int64(d/2)+1))
}

// Failing tracks a failure period of a loop that retries (renewals,
// polling, the release listener, an acquisition) so that it logs once per
// period: a warning at the first failure, debug lines for the repeats, and
// a note when it succeeds again. The zero value is ready; it is not safe
// for concurrent use (one loop owns it).
type Failing struct {
	n int
}

// Fail records a failure: the first of a period is logged at warn with msg
// and err, the others at debug.
func (f *Failing) Fail(log *slog.Logger, msg string, err error, args ...any) {
	if f.n == 0 {
		log.Warn(msg, append(args, "err", err)...)
	} else {
		log.Debug(msg+" (still failing)", append(args, "failures", f.n, "err", err)...)
	}
	f.n++
}

// Recover ends a failure period, if there is one, with a note saying how
// many failures it had.
func (f *Failing) Recover(log *slog.Logger, msg string, args ...any) {
	if f.n > 0 {
		log.Info(msg, append(args, "failures", f.n)...)
		f.n = 0
	}
}

// Count is the number of failures of the current period (0: healthy).
func (f *Failing) Count() int { return f.n }

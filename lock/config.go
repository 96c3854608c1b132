package lock

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/idleholder"
	"github.com/pgfence/pgfence/internal/ownconn"
)

// Config configures a Client. The zero value is usable: every field documents
// its default.
type Config struct {
	// TTL is how long a lease stays valid at the database after it was
	// acquired or last renewed, judged by the database's clock.
	// Default 15s. At least MinTTL (200ms) and 2 x RenewInterval.
	TTL time.Duration

	// RenewInterval is how often the client renews all the leases it holds,
	// in one statement. Default TTL/3.
	RenewInterval time.Duration

	// SafetyMargin is taken off the TTL to get the local trust window: a
	// holder trusts its lease until (the time its last successful
	// acquire/renew request was sent) + TTL - SafetyMargin on Go's monotonic
	// clock, and cancels the lease's context then at the latest. It absorbs
	// the client's and server's clocks running at slightly different rates.
	// Default TTL/10. Must be smaller than TTL - RenewInterval, so that
	// at least one renewal can land inside the window.
	SafetyMargin time.Duration

	// PollInterval is how often the client looks at the leases its blocked
	// Acquires wait for, in case no release notification arrives (an
	// expiry sends none): one statement for all of them, jittered by ±25%,
	// and sooner when one is about to expire.
	// It is also the first step of the backoff after transient errors (up
	// to 10 x PollInterval). Default 1s; at least MinPollInterval.
	PollInterval time.Duration

	// GuardIdleTimeout, if positive, bounds at the server how long a
	// transaction guarded by one of the client's leases may sit idle
	// between statements (fence.Guard.IdleTimeout; 0, the default, and
	// negative are none). Takeovers do not need it (IdleHolderAfter);
	// set it when the takers cannot end the holder's sessions, at 4-6% of
	// a one-row transaction (BENCHMARKS.md).
	GuardIdleTimeout time.Duration

	// IdleHolderAfter is how long an acquisition waits on the row of an
	// expired or released lease, held by a transaction that sits idle
	// there (a holder frozen or cut off inside a guarded transaction),
	// before it ends that transaction's session (pg_terminate_backend, on
	// a connection of the client's own: none of its writes commits), and
	// how often it looks again. It is logged, emitted (IdleHolderEnded)
	// and counted in Stats. A frozen holder is so replaced about TTL +
	// PollInterval + IdleHolderAfter after it froze; a transaction running
	// a statement is waited for (bound it with statement_timeout). Ending
	// another role's session needs pg_signal_backend and pg_read_all_stats
	// (a superuser's, a superuser); without them the acquisition waits and
	// says why once. Default 0: PollInterval / 4, within 10 ms and
	// min(1 s, TTL / 10) (250 ms with the defaults); negative: never.
	IdleHolderAfter time.Duration

	// Holder identifies this client in the leases table (for operators and
	// HeldError). At most 255 bytes of UTF-8 without NUL.
	// Default "host:pid:random".
	Holder string

	// Schema holds pgfence's tables. Default "pgfence", as everywhere in
	// pgfence (migrations.Up, runner, fence, the CLI).
	Schema string

	// Logger receives renewal failures and lease losses. Default
	// slog.Default().
	Logger *slog.Logger

	// DurableRelease makes Lease.Release wait until its commit is flushed
	// to disk (and to synchronous standbys). Default false: Release
	// commits asynchronously, making an acquire+release pair about as
	// cheap as two durable updates (BENCHMARKS.md). The release is visible
	// at once either way; a crash (or failover) in the moment before the
	// flush can only put the lease back as it was, held by its
	// old holder until its expiry, with its old token: no invariant
	// depends on a durable release. Acquisitions and renewals are always
	// durable.
	DurableRelease bool

	// MeterProvider receives the client's metrics (README's "Metrics"
	// lists them), and those of the guards of its leases. Default
	// otel.GetMeterProvider(): a no-op until the application installs an
	// OpenTelemetry SDK.
	MeterProvider metric.MeterProvider

	// OnEvent, if set, is called with each Event of the client's leases.
	// It must not block: it runs on the client's goroutines.
	OnEvent func(Event)

	// SkewWarning is how far the database's clock must surely be from
	// this machine's (beyond a renewal's round trip) before the client
	// logs a warning, once per crossing. The skew decides nothing, but one
	// near SafetyMargin eats the trust window's safety. Default
	// SafetyMargin/2; negative: never warn.
	SkewWarning time.Duration
}

// MinTTL is the shortest TTL accepted: below it, a busy server's commit
// latency or a garbage-collection pause ends a lease at once.
const MinTTL = 200 * time.Millisecond

// MinPollInterval is the smallest PollInterval accepted.
const MinPollInterval = 10 * time.Millisecond

// ErrInvalidConfig is matched by every *ConfigError.
var ErrInvalidConfig = errors.New("lock: invalid config")

// ConfigError names the configuration field that is wrong and why.
type ConfigError struct {
	// Field is the Config field at fault.
	Field string
	// Reason says what is wrong with it.
	Reason string
}

// Error names the field and the problem.
func (e *ConfigError) Error() string { return "lock: invalid config: " + e.Field + ": " + e.Reason }

// Is makes errors.Is(err, ErrInvalidConfig) true.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

func (c Config) withDefaults() Config {
	if c.TTL == 0 {
		c.TTL = 15 * time.Second
	}
	if c.RenewInterval == 0 {
		c.RenewInterval = c.TTL / 3
	}
	if c.SafetyMargin == 0 {
		c.SafetyMargin = c.TTL / 10
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.IdleHolderAfter == 0 {
		c.IdleHolderAfter = idleholder.DefaultAfter(c.TTL, c.PollInterval)
	}
	if c.Holder == "" {
		c.Holder = defaultHolder()
	}
	c.Schema = ident.Schema(c.Schema)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MeterProvider == nil {
		c.MeterProvider = otel.GetMeterProvider()
	}
	if c.SkewWarning == 0 {
		c.SkewWarning = c.SafetyMargin / 2
	}
	return c
}

func (c Config) validate() error {
	bad := func(field, format string, args ...any) error {
		return &ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case c.TTL < MinTTL:
		return bad("TTL", "must be at least %v (MinTTL), got %v", MinTTL, c.TTL)
	case c.RenewInterval <= 0:
		return bad("RenewInterval", "must be positive, got %v", c.RenewInterval)
	case c.SafetyMargin < 0:
		return bad("SafetyMargin", "must not be negative, got %v", c.SafetyMargin)
	case c.PollInterval < MinPollInterval:
		return bad("PollInterval", "must be at least %v, got %v", MinPollInterval, c.PollInterval)
	case c.RenewInterval > c.TTL/2: // not 2*RenewInterval > TTL, which can overflow
		return bad("RenewInterval", "%v leaves no room for a failed renewal: TTL (%v) must be at least twice RenewInterval", c.RenewInterval, c.TTL)
	case c.SafetyMargin >= c.TTL-c.RenewInterval:
		return bad("SafetyMargin", "%v must be smaller than TTL - RenewInterval (%v)", c.SafetyMargin, c.TTL-c.RenewInterval)
	case len(c.Holder) > 255 || !utf8.ValidString(c.Holder) || strings.ContainsRune(c.Holder, 0):
		return bad("Holder", "must be at most 255 bytes of UTF-8 without NUL")
	}
	if err := ident.ValidateSchema(c.Schema); err != nil {
		return bad("Schema", "%v", err)
	}
	return nil
}

// validatePool checks a multi-host connection string (a Patroni,
// CloudNativePG or repmgr cluster) against the lease timings: its
// connect_timeout must fit in what a renewal has left to reconnect after
// a failover, TTL - SafetyMargin - RenewInterval.
func (c Config) validatePool(pc *pgxpool.Config) error {
	bad := func(reason string, args ...any) error {
		return &ConfigError{Field: "pool (connection string)", Reason: fmt.Sprintf(reason, args...)}
	}
	cc := pc.ConnConfig
	hosts := ownconn.Hosts(cc)
	budget := c.TTL - c.SafetyMargin - c.RenewInterval
	switch {
	case hosts > 1 && cc.ValidateConnect == nil:
		return bad("%d hosts without target_session_attrs: set target_session_attrs=read-write (or primary), "+
			"or clients may connect to a standby, where nothing can be acquired", hosts)
	case hosts > 1 && cc.ConnectTimeout <= 0:
		return bad("%d hosts without connect_timeout: set it (a few seconds), or a host that does not answer "+
			"during a failover holds every new connection until the caller gives up", hosts)
	case hosts > 1 && cc.ConnectTimeout >= budget:
		return bad("connect_timeout %v must be below TTL - SafetyMargin - RenewInterval (%v), "+
			"the time a renewal has to reconnect after a failover", cc.ConnectTimeout, budget)
	}
	return nil
}

func defaultHolder() string {
	host, err := os.Hostname()
	if err != nil {
		host = "unknown"
	}
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b))
}

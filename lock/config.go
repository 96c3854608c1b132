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
	// Acquires wait for, in case no release notification arrives (a lease
	// that expires without being released sends none): one statement per
	// interval for all of them, jittered by ±25%, and sooner when one of
	// them is about to expire. It is also the first
	// step of the capped exponential backoff after transient errors (up
	// to 10 x PollInterval). Default 1s; at least MinPollInterval.
	PollInterval time.Duration

	// GuardIdleTimeout, if positive, bounds at the server how long a
	// transaction guarded by one of the client's leases (Lease.RunTx,
	// Lease.Guard) may sit idle between its statements: past it the server
	// ends the transaction's session (fence.Guard.IdleTimeout). It is not
	// needed for takeovers, which end a holder's session idle on the lease
	// row past its expiry themselves (see IdleHolderAfter); set it when
	// the takers cannot (IdleHolderAfter negative, or a role without the
	// right to end the holder's sessions), at the price of changing a setting in
	// every guarded transaction (4-6% of a one-row transaction on
	// PostgreSQL 15 and 17: BENCHMARKS.md). fence.Guard.IdleTimeout's rule: 0,
	// the default, is none; negative is none too; positive is the bound.
	GuardIdleTimeout time.Duration

	// IdleHolderAfter is how long an acquisition waits on the lease row
	// of an expired or released lease, held by a transaction that sits
	// idle there, before it ends that transaction's session: a holder
	// frozen (a GC pause, SIGSTOP, a stalled VM) or cut off inside a
	// guarded transaction. It ends the session of each such transaction
	// idle for IdleHolderAfter or more (pg_terminate_backend, on a
	// connection of the client's own outside the pool), logs it, counts
	// it in Stats.IdleHoldersEnded, and looks again every IdleHolderAfter
	// while it waits. The session's transaction aborts, so none of its
	// writes commits, and the acquisition goes on: a frozen holder is
	// replaced about TTL + PollInterval + IdleHolderAfter after it froze.
	// A transaction running a statement is not idle and is waited for:
	// bound those with statement_timeout. The client's role needs the
	// right to end the session: the holder's own role has it; another
	// needs pg_signal_backend, and pg_read_all_stats to see the session's
	// state (only a superuser may end a superuser's session). Without it
	// the acquisition waits, and the client logs why, once per
	// acquisition. Default 0: PollInterval / 4, within 10 ms and the
	// smaller of 1 s and TTL / 10 (250 ms with the default TTL and
	// PollInterval); negative: never, the client's acquisitions wait
	// however long such a transaction sits there.
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
	// to disk (and to synchronous standbys), like any other commit.
	// Default false: Release commits asynchronously, which makes an
	// acquire+release pair about as cheap as two plain durable updates
	// (BENCHMARKS.md). The release is visible to every other session at
	// once either way; only a database crash (or failover) in the fraction
	// of a second before the WAL writer flushes it can undo it, and then
	// the lease is back as it was before Release: held by its old holder,
	// with its old token and old expiry. It then expires by the database
	// clock no later than it would have had the holder died, and its next
	// acquisition gets a greater token as always: no invariant depends on
	// a release being durable, only how soon the next holder can take
	// over after a crash. Acquisitions and renewals are always durable,
	// since tokens and expiry times must survive a crash.
	DurableRelease bool

	// MeterProvider receives the client's metrics (README's "Metrics"
	// lists them), and those of the guards of its leases. Default
	// otel.GetMeterProvider(): a no-op until the application installs an
	// OpenTelemetry SDK.
	MeterProvider metric.MeterProvider

	// OnEvent, if set, is called when a lease is acquired, renewed late,
	// lost (with its cause) or released, so applications can log or page
	// without polling. It must not block: it runs on the client's
	// goroutines (the renewer, a lease's timer, the caller's).
	OnEvent func(Event)

	// SkewWarning is how far the database's clock must surely be from
	// this machine's before the client logs a warning (once per crossing,
	// and once when it is back under). A renewal's round trip bounds what
	// it can tell: a difference within the round trip is not counted as
	// skew, so a slow round trip never warns. pgfence never uses the skew for
	// decisions, but a skew near SafetyMargin eats the safety the trust
	// window gives. Default SafetyMargin/2; negative: never warn.
	SkewWarning time.Duration
}

// MinTTL is the shortest TTL accepted. A lease must outlive the renewal
// round trip that keeps it, with room for a late one: below this, a busy
// server's commit latency or a garbage-collection pause ends the lease at
// once, and acquisitions race their own expiry.
const MinTTL = 200 * time.Millisecond

// MinPollInterval is the smallest PollInterval accepted: below it, blocked
// acquirers would spend the database's time polling instead of waiting for
// the release notification.
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
		c.IdleHolderAfter = idleHolderAfterFor(c.TTL, c.PollInterval)
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

// validatePool checks the pool's connection settings against the lease
// timings. A multi-host connection string (a Patroni, CloudNativePG or
// repmgr cluster) needs target_session_attrs, or clients connect to a
// standby and acquire nothing there, and connect_timeout, or a host that
// does not answer holds each new connection until the caller gives up. And
// its connect_timeout must fit in the time a renewal has to reconnect after
// the primary failed: TTL - SafetyMargin - RenewInterval, the trust window
// left after a renewal that started on time.
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
	return fmt.Sprintf("%s:%d:%s", host, os.Getpid(), randHex(4))
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

package runner

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/lock"
)

// Config configures a Runner. Every field documents its default.
type Config struct {
	// Schema holds pgfence's tables. Default "" (search_path).
	Schema string

	// Instance identifies this runner (the lease holder and the instance
	// row). Must be unique among live runners. At most 255 bytes.
	// Default "host:pid:random".
	Instance string

	// TTL of the job leases and of this instance's liveness row, judged
	// by the database clock. Default 15s.
	TTL time.Duration

	// RenewInterval is how often leases are renewed. Default TTL/3.
	RenewInterval time.Duration

	// PollInterval is how often a replica that does not lead a job checks
	// whether it can take it over, when no release notification arrives
	// (a leader that died sends none). Default 1s.
	PollInterval time.Duration

	// RebalanceInterval is how often this instance heartbeats and
	// recomputes its share of sharded jobs. Default 5s; must be < TTL.
	RebalanceInterval time.Duration

	// ShutdownTimeout bounds how long Run waits, after its context ends,
	// for running jobs to return once their contexts are cancelled.
	// Default 10s.
	ShutdownTimeout time.Duration

	// Logger receives the runner's log. Default slog.Default().
	Logger *slog.Logger

	// OnEvent, if set, is called for every job and leadership event. It
	// must not block for long: it runs on the job's goroutine.
	OnEvent func(Event)
}

// EventKind says what happened.
type EventKind int

// Event kinds.
const (
	LeadershipGained EventKind = iota // the instance took a job's (or shard's) lease
	LeadershipLost                    // the lease ended (lost, or released on shutdown/rebalance)
	RunStarted                        // an attempt for a slot started
	RunSucceeded                      // the attempt's success was recorded
	RunFailed                         // the attempt failed (Err); it may be retried
	RunFenced                         // the attempt lost its lease or was refused as stale
)

// String returns the kind in snake_case, for logs and metrics labels.
func (k EventKind) String() string {
	return [...]string{"leadership_gained", "leadership_lost", "run_started", "run_succeeded", "run_failed", "run_fenced"}[k]
}

// Event describes something that happened to a job on this instance.
type Event struct {
	// Kind says what happened.
	Kind EventKind
	// Job and Shard say to which job (and shard; 0 if unsharded).
	Job   string
	Shard int
	// Slot is the schedule slot of a run event; zero for leadership events.
	Slot time.Time
	// Token is the lease token involved.
	Token fence.Token
	// Attempt is the run's attempt number (run events).
	Attempt int
	// Err is the error of a failed or fenced run, or why leadership ended.
	Err error
}

// ErrInvalidConfig is matched by every *ConfigError.
var ErrInvalidConfig = errors.New("runner: invalid config")

// ConfigError names the configuration field that is wrong.
type ConfigError struct {
	// Field is the Config field at fault; Reason says what is wrong.
	Field, Reason string
}

// Error names the field and the problem.
func (e *ConfigError) Error() string { return "runner: invalid config: " + e.Field + ": " + e.Reason }

// Is makes errors.Is(err, ErrInvalidConfig) true.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// checkSigns refuses negative durations, before defaults replace zeros.
func (c Config) checkSigns() error {
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"TTL", c.TTL}, {"RenewInterval", c.RenewInterval}, {"PollInterval", c.PollInterval},
		{"RebalanceInterval", c.RebalanceInterval}, {"ShutdownTimeout", c.ShutdownTimeout}} {
		if f.d < 0 {
			return &ConfigError{f.name, fmt.Sprintf("%v is negative", f.d)}
		}
	}
	return nil
}

// lockConfig is the configuration of the runner's lease client.
func (c Config) lockConfig() lock.Config {
	return lock.Config{TTL: c.TTL, RenewInterval: c.RenewInterval, PollInterval: c.PollInterval,
		Holder: c.Instance, Schema: c.Schema, Logger: c.Logger}
}

// fromLock names a lease-client configuration error with the runner's
// field names.
func fromLock(err error) error {
	var ce *lock.ConfigError
	if !errors.As(err, &ce) {
		return err
	}
	field := ce.Field
	if field == "Holder" {
		field = "Instance"
	}
	return &ConfigError{field, ce.Reason}
}
func (c Config) withDefaults() Config {
	if c.TTL == 0 {
		c.TTL = 15 * time.Second
	}
	if c.RenewInterval == 0 {
		c.RenewInterval = c.TTL / 3
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Second
	}
	if c.RebalanceInterval == 0 {
		c.RebalanceInterval = min(5*time.Second, c.TTL/2)
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func (c Config) validate() error {
	bad := func(f, format string, a ...any) error { return &ConfigError{f, fmt.Sprintf(format, a...)} }
	switch {
	case c.RebalanceInterval <= 0 || c.RebalanceInterval >= c.TTL:
		return bad("RebalanceInterval", "%v must be positive and less than TTL (%v)", c.RebalanceInterval, c.TTL)
	case c.ShutdownTimeout < 0:
		return bad("ShutdownTimeout", "%v is negative", c.ShutdownTimeout)
	case len(c.Instance) > 255 || !utf8.ValidString(c.Instance) || strings.ContainsRune(c.Instance, 0):
		return bad("Instance", "must be at most 255 bytes of UTF-8 without NUL")
	}
	if err := ident.ValidateSchema(c.Schema); err != nil {
		return bad("Schema", "%v", err)
	}
	return nil
}

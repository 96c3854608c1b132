package runner

import (
	"errors"
	"fmt"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
)

// Config configures a Runner. Every field documents its default.
type Config struct {
	// Lock configures the leases of jobs and shards and names this
	// instance: Lock.Holder is the instance's id (unique among live
	// runners; default "host:pid:random"), Lock.Schema holds pgfence's
	// tables, Lock.Logger receives the runner's log too, Lock.TTL is also
	// the TTL of this instance's liveness row, and Lock.PollInterval is how
	// often a replica that does not lead a job checks whether it can take
	// it over when no release notification arrives (a leader that died
	// sends none). Every field has lock.Config's default.
	Lock lock.Config

	// RebalanceInterval is how often this instance heartbeats and
	// recomputes its share of sharded jobs. Default min(5s, Lock.TTL/2);
	// must be < Lock.TTL.
	RebalanceInterval time.Duration

	// ShutdownTimeout bounds how long Run waits, after its context ends,
	// for running jobs to return once their contexts are cancelled.
	// Default 10s.
	ShutdownTimeout time.Duration

	// Retention is how long finished runs stay in the ledger: every
	// replica prunes older ones hourly (see Prune), keeping the latest slot
	// of each job and shard. Default 30 days; negative: keep every run.
	Retention time.Duration

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
	switch {
	case c.RebalanceInterval < 0:
		return &ConfigError{"RebalanceInterval", fmt.Sprintf("%v is negative", c.RebalanceInterval)}
	case c.ShutdownTimeout < 0:
		return &ConfigError{"ShutdownTimeout", fmt.Sprintf("%v is negative", c.ShutdownTimeout)}
	}
	return nil
}

// fromLock names a lease-client configuration error as a field of Lock.
func fromLock(err error) error {
	var ce *lock.ConfigError
	if !errors.As(err, &ce) {
		return err
	}
	return &ConfigError{"Lock." + ce.Field, ce.Reason}
}

// withDefaults fills in defaults; lcfg is the lease client's configuration
// with its own defaults filled in.
func (c Config) withDefaults(lcfg lock.Config) Config {
	c.Lock = lcfg
	if c.RebalanceInterval == 0 {
		c.RebalanceInterval = min(5*time.Second, c.Lock.TTL/2)
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.Retention == 0 {
		c.Retention = 30 * 24 * time.Hour
	}
	return c
}

func (c Config) validate() error {
	bad := func(f, format string, a ...any) error { return &ConfigError{f, fmt.Sprintf(format, a...)} }
	switch {
	case c.RebalanceInterval <= 0 || c.RebalanceInterval >= c.Lock.TTL:
		return bad("RebalanceInterval", "%v must be positive and less than Lock.TTL (%v)", c.RebalanceInterval, c.Lock.TTL)
	case c.ShutdownTimeout < 0:
		return bad("ShutdownTimeout", "%v is negative", c.ShutdownTimeout)
	}
	return nil
}

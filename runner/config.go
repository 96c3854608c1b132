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
	// RebalanceInterval is how often this instance heartbeats and
	// recomputes its share of sharded jobs and which singleton jobs it is
	// preferred for; a leader that is not a singleton job's preferred
	// replica hands it over once its term is this old. Default min(5s,
	// TTL/2), with the client's TTL; must be below the TTL.
	RebalanceInterval time.Duration

	// ShutdownTimeout bounds how long Run waits, after its context ends,
	// for running jobs to return once their contexts are cancelled.
	// Releasing the leases of jobs that did not stop (all at once) and
	// recording the leave then take at most 5s more (wait.CleanupTimeout,
	// and wait.PastDeadline, 500ms, for releases still unconfirmed then),
	// whatever the network does: Run returns within ShutdownTimeout + 5.5s
	// of its context's end. Default 10s.
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
	RunSkipped                        // a scheduled slot fell due while the job was paused
)

// String returns the kind in snake_case, for logs and metrics labels.
func (k EventKind) String() string {
	return [...]string{"leadership_gained", "leadership_lost", "run_started", "run_succeeded", "run_failed", "run_fenced", "run_skipped"}[k]
}

// Event describes something that happened to a job on this instance.
type Event struct {
	// Kind says what happened.
	Kind EventKind
	// Job and Shard say to which job (and shard; 0 if unsharded).
	Job   string
	Shard int
	// Slot is the slot of a run event (for a manual run, when it was
	// asked for); zero for leadership events.
	Slot time.Time
	// Manual is true for the events of a manual run (RunNow).
	Manual bool
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

// withDefaults fills in defaults; lcfg is the lease client's configuration.
func (c Config) withDefaults(lcfg lock.Config) Config {
	if c.RebalanceInterval == 0 {
		c.RebalanceInterval = min(5*time.Second, lcfg.TTL/2)
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = 10 * time.Second
	}
	if c.Retention == 0 {
		c.Retention = 30 * 24 * time.Hour
	}
	return c
}

func (c Config) validate(lcfg lock.Config) error {
	bad := func(f, format string, a ...any) error { return &ConfigError{f, fmt.Sprintf(format, a...)} }
	switch {
	case c.RebalanceInterval <= 0 || c.RebalanceInterval >= lcfg.TTL:
		return bad("RebalanceInterval", "%v must be positive and less than the lock client's TTL (%v)", c.RebalanceInterval, lcfg.TTL)
	case c.ShutdownTimeout < 0:
		return bad("ShutdownTimeout", "%v is negative", c.ShutdownTimeout)
	}
	return nil
}

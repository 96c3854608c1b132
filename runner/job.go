package runner

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/pgfence/pgfence/fence"
)

// Job is work that must run on exactly one machine per schedule slot (or,
// for a sharded job, on exactly one machine per shard and slot).
type Job struct {
	// Name identifies the job across replicas: every replica registers the
	// same jobs under the same names. 1-200 bytes of UTF-8. Required.
	Name string

	// Schedule says when the job runs, in one of these forms:
	//   "@every 10m"                     a fixed interval; slots are multiples of it since the Unix epoch,
	//                                    so every replica computes the same slots
	//   "0 2 * * *"                      a standard 5-field cron expression, in UTC
	//   "CRON_TZ=Europe/Paris 0 2 * * *" cron in a time zone
	//   "@daily", "@hourly", ...         cron descriptors (UTC unless CRON_TZ is given)
	// Required.
	Schedule string

	// Run does the work for one slot. Its context is cancelled when the
	// lease is lost (the run is then fenced: its guarded writes are
	// refused), when Timeout passes, and when the runner shuts down.
	// Put every protected write through run.RunTx or run.CommitTx.
	// Required.
	Run func(ctx context.Context, run *Run) error

	// Timeout bounds one attempt. Default 0: no bound other than the lease.
	Timeout time.Duration

	// Retry is the policy for attempts that return an error.
	// Default: one attempt, no retry.
	Retry Retry

	// Missed says what to do with slots that passed while no replica ran
	// the job (downtime). Default RunLatest.
	Missed Missed
}

// Retry is a retry policy for failed attempts of a slot.
type Retry struct {
	// MaxAttempts is the most attempts a slot gets. Default 1.
	MaxAttempts int
	// Backoff is the wait before each retry. Default 1s.
	Backoff time.Duration
}

// Missed is a policy for slots missed during downtime.
type Missed int

const (
	// RunLatest runs the latest missed slot once when a replica takes the
	// job over; earlier missed slots are skipped.
	RunLatest Missed = iota
	// Skip runs no missed slot: a replica that takes the job over waits
	// for the next slot, unless the latest one is less than a second old.
	Skip
)

var (
	// ErrInvalidJob is returned by Register for a job that cannot run: no
	// name, no Run function, negative values, a bad shard count. The
	// error's text names the field.
	ErrInvalidJob = errors.New("runner: invalid job")
	// ErrInvalidSchedule is returned by Register for a schedule that does
	// not parse. It also matches ErrInvalidJob.
	ErrInvalidSchedule = fmt.Errorf("%w: schedule", ErrInvalidJob)
	// ErrDuplicateJob is returned by Register when the name is taken.
	ErrDuplicateJob = errors.New("runner: duplicate job name")
	// ErrRunning is returned by Register after Run has started.
	ErrRunning = errors.New("runner: already running")
	// ErrFenced is returned by Run.CommitTx (and recorded) when the run's
	// slot was claimed by a newer token: the run is a zombie. It matches
	// fence.ErrFenced; a refused guard returns fence.ErrStaleToken instead.
	ErrFenced error = runFenced{}
)

// Schedule yields a job's slots.
type Schedule interface {
	// Next returns the first slot strictly after t.
	Next(t time.Time) time.Time
}

// every is an interval schedule aligned to the Unix epoch.
type every time.Duration

func (e every) Next(t time.Time) time.Time {
	d := time.Duration(e)
	return t.Truncate(d).Add(d)
}

// ParseSchedule parses a Job.Schedule string.
func ParseSchedule(s string) (Schedule, error) {
	s = strings.TrimSpace(s)
	if rest, ok := strings.CutPrefix(s, "@every "); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("%w: %q: want @every and a positive duration such as 10m", ErrInvalidSchedule, s)
		}
		if d < time.Millisecond {
			return nil, fmt.Errorf("%w: %q: the interval must be at least 1ms", ErrInvalidSchedule, s)
		}
		return every(d), nil
	}
	if s == "" {
		return nil, fmt.Errorf("%w: empty", ErrInvalidSchedule)
	}
	sched, err := cron.ParseStandard(s)
	if err != nil {
		return nil, fmt.Errorf("%w: %q: %v", ErrInvalidSchedule, s, err)
	}
	return sched, nil
}

func (j *Job) validate() (Schedule, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidJob, fmt.Sprintf(format, args...))
	}
	if err := fence.ValidateName(j.Name); err != nil || len(j.Name) > 200 {
		return nil, bad("Name %q: 1-200 bytes of UTF-8 without NUL", j.Name)
	}
	if j.Run == nil {
		return nil, bad("job %q: Run is nil", j.Name)
	}
	if j.Timeout < 0 {
		return nil, bad("job %q: Timeout %v is negative", j.Name, j.Timeout)
	}
	if j.Retry.MaxAttempts < 0 || j.Retry.Backoff < 0 {
		return nil, bad("job %q: Retry has a negative value", j.Name)
	}
	if j.Missed != RunLatest && j.Missed != Skip {
		return nil, bad("job %q: unknown Missed policy %d", j.Name, j.Missed)
	}
	sched, err := ParseSchedule(j.Schedule)
	if err != nil {
		return nil, fmt.Errorf("job %q: %w", j.Name, err)
	}
	if j.Retry.MaxAttempts == 0 {
		j.Retry.MaxAttempts = 1
	}
	if j.Retry.Backoff == 0 {
		j.Retry.Backoff = time.Second
	}
	return sched, nil
}

// runFenced is ErrFenced's type: it matches fence.ErrFenced too.
type runFenced struct{}

func (runFenced) Error() string { return "runner: run fenced by a newer attempt" }

func (runFenced) Is(target error) bool { return target == fence.ErrFenced }

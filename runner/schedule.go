package runner

import (
	"fmt"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// Schedule yields a job's slots.
type Schedule interface {
	// Next returns the first slot strictly after t.
	Next(t time.Time) time.Time
}

// MinEvery is the shortest @every interval accepted: each slot takes a
// lease and writes the ledger, and below this the bookkeeping of one slot
// outlasts the slot.
const MinEvery = 100 * time.Millisecond

// every is an interval schedule aligned to the Unix epoch.
type every time.Duration

// Next returns the first multiple of the interval since the Unix epoch
// that is after t.
func (e every) Next(t time.Time) time.Time { return e.floor(t).Add(time.Duration(e)) }

// floor returns the latest multiple of the interval since the Unix epoch
// at or before t, in UTC.
func (e every) floor(t time.Time) time.Time {
	d, n := int64(e), t.UnixNano()
	q := n / d
	if n%d < 0 {
		q--
	}
	return time.Unix(0, q*d).UTC()
}

// cronSchedule is a cron expression evaluated in one time zone, never the
// machine's local one.
type cronSchedule struct{ spec *cron.SpecSchedule }

func (c cronSchedule) Next(t time.Time) time.Time { return c.spec.Next(t) }

// ParseSchedule parses a Job.Schedule string (see Job.Schedule for the
// forms). Cron expressions are evaluated in UTC unless they start with
// CRON_TZ=<zone> (or TZ=<zone>), whatever the machine's local time zone is,
// so that every replica computes the same slots. It returns an error wrapping
// ErrInvalidSchedule, never panics, and refuses a schedule that never fires.
func ParseSchedule(s string) (sched Schedule, err error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %q: %s", ErrInvalidSchedule, s, fmt.Sprintf(format, args...))
	}
	spec := strings.TrimSpace(s)
	if spec == "" {
		return nil, fmt.Errorf("%w: empty", ErrInvalidSchedule)
	}
	loc := time.UTC
	if strings.HasPrefix(spec, "CRON_TZ=") || strings.HasPrefix(spec, "TZ=") {
		prefix, rest, _ := strings.Cut(spec, " ")
		_, zone, _ := strings.Cut(prefix, "=")
		spec = strings.TrimSpace(rest)
		switch {
		case zone == "":
			return nil, bad("no time zone after %s", prefix)
		case zone == "Local":
			return nil, bad("the machine's local time zone differs between replicas; name the zone")
		case spec == "":
			return nil, bad("no schedule after the time zone")
		case strings.HasPrefix(spec, "CRON_TZ=") || strings.HasPrefix(spec, "TZ="):
			return nil, bad("more than one time zone")
		}
		if loc, err = time.LoadLocation(zone); err != nil {
			return nil, bad("unknown time zone %q", zone)
		}
	}
	if rest, ok := strings.CutPrefix(spec, "@every "); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		switch {
		case err != nil || d <= 0:
			return nil, bad("want @every and a positive duration such as 10m")
		case d < MinEvery:
			return nil, bad("the interval must be at least %v (MinEvery)", MinEvery)
		}
		return every(d), nil
	}
	// The cron library has panicked on malformed input before: whatever
	// it does, a bad schedule is an error, never a crash.
	defer func() {
		if p := recover(); p != nil {
			sched, err = nil, bad("%v", p)
		}
	}()
	parsed, err := cron.ParseStandard(spec)
	if err != nil {
		return nil, bad("%v", err)
	}
	cs, ok := parsed.(*cron.SpecSchedule)
	if !ok {
		return nil, bad("unsupported form")
	}
	cs.Location = loc
	// robfig/cron looks five years ahead and returns the zero time when it
	// finds nothing: such a schedule would run once for year 1, then spin.
	if cs.Next(time.Now()).IsZero() {
		return nil, bad("never fires")
	}
	return cronSchedule{cs}, nil
}

// latestDue returns the latest slot in (after, now], or the zero time.
func latestDue(s Schedule, after, now time.Time) time.Time {
	if e, ok := s.(every); ok {
		due := e.floor(now)
		if due.After(after) {
			return due
		}
		return time.Time{}
	}
	var due time.Time
	for t, i := s.Next(after), 0; !t.IsZero() && !t.After(now) && i < 1_000_000; t, i = s.Next(t), i+1 {
		due = t
	}
	return due
}

// slotsBetween counts the slots of s strictly after a and strictly before
// b (at most 100,000).
func slotsBetween(s Schedule, a, b time.Time) int {
	if e, ok := s.(every); ok {
		if !b.After(a) {
			return 0
		}
		n := int(e.floor(b.Add(-1)).Sub(e.floor(a)) / time.Duration(e))
		return max(n, 0)
	}
	n := 0
	for t := s.Next(a); !t.IsZero() && t.Before(b) && n < 100_000; t = s.Next(t) {
		n++
	}
	return n
}

// skipGrace is how old the latest missed slot may be for Skip to still run
// it: a replica that takes a job over just after a slot fell due (its
// leader stopped at the slot) runs it rather than skipping it.
const skipGrace = time.Second

// catchUp returns the missed slots a new leader runs, oldest first, when
// the latest slot in the ledger is last and the time is now, and how many
// missed slots it leaves unrun (the latest slot in (last, now] and the
// ones before it are "missed").
func catchUp(s Schedule, p Missed, last, now time.Time) (run []time.Time, unrun int) {
	due := latestDue(s, last, now)
	if due.IsZero() {
		return nil, 0
	}
	missed := 1 + slotsBetween(s, last, due)
	n := p.slots()
	if p == Skip && now.Sub(due) < skipGrace {
		n = 1
	}
	n = min(n, missed)
	if n == 0 {
		return nil, missed
	}
	run = make([]time.Time, n)
	if e, ok := s.(every); ok {
		for i := range run {
			run[n-1-i] = due.Add(-time.Duration(i) * time.Duration(e))
		}
		return run, missed - n
	}
	// A cron schedule only steps forward: keep the latest n in a ring.
	k := 0
	for t := s.Next(last); !t.IsZero() && !t.After(due) && k < 1_000_000; t = s.Next(t) {
		run[k%n] = t
		k++
	}
	if k >= n {
		run = append(run[k%n:], run[:k%n]...)
	}
	return run, missed - n
}

// overrun returns the slot to run once the wait for next is over at now:
// next itself, or, when later slots have also fallen due meanwhile (the
// previous run outlasted them), the latest of those; missed counts the
// slots passed over.
func overrun(s Schedule, next, now time.Time) (slot time.Time, missed int) {
	due := latestDue(s, next, now)
	if due.IsZero() {
		return next, 0
	}
	return due, 1 + slotsBetween(s, next, due)
}

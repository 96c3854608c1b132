package runner

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// Cron is UTC unless it names a zone, whatever time.Local is.
// The test runs itself again with TZ=America/New_York (time.Local is read
// from TZ when a process starts).
func TestCronIsUTCWhateverTheLocalZone(t *testing.T) {
	if os.Getenv("PGFENCE_TZ_CHILD") == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestCronIsUTCWhateverTheLocalZone$", "-test.count=1")
		cmd.Env = append(os.Environ(), "PGFENCE_TZ_CHILD=1", "TZ=America/New_York")
		if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "PASS") {
			t.Fatalf("under TZ=America/New_York: %v\n%s", err, out)
		}
	} else if _, off := time.Now().In(time.Local).Zone(); off == 0 {
		t.Fatal("the child process did not get a non-UTC local zone")
	}
	// In the machine's zone, as the runner passes time.Now(): robfig/cron
	// evaluates a schedule without a zone in the zone of the time given.
	from := time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC).In(time.Local)
	for _, c := range []struct {
		spec string
		want time.Time
	}{
		{"0 2 * * *", time.Date(2026, 6, 2, 2, 0, 0, 0, time.UTC)},
		{"@daily", time.Date(2026, 6, 2, 0, 0, 0, 0, time.UTC)},
		{"CRON_TZ=Europe/Paris 0 2 * * *", time.Date(2026, 6, 2, 0, 0, 0, 0, time.UTC)}, // CEST = UTC+2
		{"TZ=Asia/Tokyo 0 2 * * *", time.Date(2026, 6, 1, 17, 0, 0, 0, time.UTC)},       // JST = UTC+9
	} {
		s, err := ParseSchedule(c.spec)
		if err != nil {
			t.Fatalf("ParseSchedule(%q): %v", c.spec, err)
		}
		if got := s.Next(from); !got.Equal(c.want) {
			t.Errorf("%q after %v: %v, want %v (local zone %v)", c.spec, from, got.UTC(), c.want, time.Local)
		}
	}
}

// No schedule can crash or spin the process: malformed and
// never-firing schedules are errors.
func TestBadSchedulesAreErrors(t *testing.T) {
	for _, spec := range []string{
		"TZ=", "CRON_TZ=", "CRON_TZ=UTC", "CRON_TZ=Europe/Paris", "TZ=Mars/Olympus 0 2 * * *",
		"CRON_TZ=Local 0 2 * * *", "CRON_TZ=UTC TZ=UTC 0 2 * * *", "0 0 30 2 *", "0 0 31 4 *",
		"61 * * * *", "* * * *", "@every", "@every 0s", "@every -1m", "@every 1ns", "@every 1ms", "@every 99ms", "@fortnightly", "",
	} {
		s, err := ParseSchedule(spec)
		if err == nil || !errors.Is(err, ErrInvalidSchedule) || s != nil {
			t.Errorf("ParseSchedule(%q) = %v, %v; want an ErrInvalidSchedule", spec, s, err)
		}
	}
}

// @every slots are multiples of the interval since the Unix
// epoch (formerly they were truncated from year 1: a weekly slot began on a
// Monday, not on the epoch's Thursday).
func TestEveryIsAlignedToTheUnixEpoch(t *testing.T) {
	for _, c := range []struct {
		every string
		at    time.Time
		want  time.Time
	}{
		{"@every 168h", time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC), time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC)}, // a Thursday
		{"@every 7m", time.Unix(7*60*1000+1, 0), time.Unix(7*60*1001, 0)},
		{"@every 10m", time.Date(2026, 11, 30, 12, 9, 59, 0, time.UTC), time.Date(2026, 11, 30, 12, 10, 0, 0, time.UTC)},
		{"@every 10m", time.Date(2026, 11, 30, 12, 10, 0, 0, time.UTC), time.Date(2026, 11, 30, 12, 20, 0, 0, time.UTC)},
		{"@every 1h", time.Date(1969, 12, 31, 23, 30, 0, 0, time.UTC), time.Unix(0, 0)},
	} {
		s, err := ParseSchedule(c.every)
		if err != nil {
			t.Fatal(err)
		}
		if got := s.Next(c.at); !got.Equal(c.want) {
			t.Errorf("%s after %v: %v, want %v", c.every, c.at, got, c.want)
		}
		if got := s.Next(c.at); got.UnixNano()%int64(time.Duration(s.(every))) != 0 {
			t.Errorf("%s: slot %v is not a multiple of the interval since the epoch", c.every, got)
		}
	}
	if due := latestDue(every(time.Hour), time.Unix(0, 0), time.Unix(3*3600+5, 0)); !due.Equal(time.Unix(3*3600, 0)) {
		t.Errorf("latest due hourly slot at 03:00:05 after the epoch: %v", due)
	}
}

// Constant backoff stays; capped exponential backoff with
// jitter is available.
func TestRetryWaits(t *testing.T) {
	constant := Retry{Backoff: time.Second}
	for a := 1; a <= 5; a++ {
		if w := constant.wait(a); w != time.Second {
			t.Errorf("constant backoff, attempt %d: %v", a, w)
		}
	}
	exp := Retry{Backoff: time.Second, MaxBackoff: 10 * time.Second}
	for a, ceiling := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 9: 10 * time.Second} {
		for range 50 {
			if w := exp.wait(a); w < ceiling/2 || w > ceiling {
				t.Fatalf("exponential backoff, attempt %d: %v, want within [%v, %v]", a, w, ceiling/2, ceiling)
			}
		}
	}
}

// FuzzParseSchedule: ParseSchedule never panics, and a schedule it accepts
// always has a next slot after now. The seed corpus runs with every
// `go test`; `go test -fuzz=FuzzParseSchedule ./runner` searches further.
func FuzzParseSchedule(f *testing.F) {
	for _, seed := range []string{
		"@every 10m", "0 2 * * *", "CRON_TZ=Europe/Paris 0 2 * * *", "TZ=", "CRON_TZ=UTC", "CRON_TZ=Europe/Paris",
		"0 0 30 2 *", "@daily", "@every 1ns", "*/5 * * * *", "0 0 29 2 *", "TZ=UTC  @hourly", "CRON_TZ= 0 0 * * *",
		"1-5/2 3,4 * JAN-MAR MON-FRI", "0 0 1 1 ?", "\t@every 1h\n", "@every 9223372036854775807ns",
	} {
		f.Add(seed)
	}
	now := time.Now()
	f.Fuzz(func(t *testing.T, spec string) {
		s, err := ParseSchedule(spec)
		if err != nil {
			if !errors.Is(err, ErrInvalidSchedule) {
				t.Fatalf("ParseSchedule(%q): %v does not match ErrInvalidSchedule", spec, err)
			}
			return
		}
		if next := s.Next(now); !next.After(now) {
			t.Fatalf("ParseSchedule(%q) accepted a schedule whose next slot is %v", spec, next)
		}
	})
}

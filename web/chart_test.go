package web

import (
	"html"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/runner"
)

func TestScheduleWords(t *testing.T) {
	for spec, want := range map[string]string{
		"@every 10m":                       "every 10m",
		"@daily":                           "every day at 00:00 UTC",
		"@hourly":                          "every hour, on the hour",
		"30 2 * * *":                       "every day at 02:30 UTC",
		"CRON_TZ=Europe/Paris 0 9 * * 1-5": "on weekdays at 09:00 Europe/Paris",
		"0 6 * * 1":                        "every Monday at 06:00 UTC",
		"15 * * * *":                       "every hour at minute 15",
		"*/5 * * * *":                      "every 5 minutes",
		"0 */6 * * *":                      "every 6 hours at minute 0 (UTC)",
		"0 0 1,15 * *":                     "cron 0 0 1,15 * * (UTC)",
		"* * * * *":                        "every minute",
	} {
		if got := scheduleWords(spec); got != want {
			t.Errorf("scheduleWords(%q) = %q, want %q", spec, got, want)
		}
	}
}

// Failures in a row are counted per shard back to the latest success;
// running and skipped attempts neither count nor end a streak; a streak
// that reaches the end of what was read is "at least".
func TestConsecutiveFailures(t *testing.T) {
	r := func(shard int, st runner.Status) runner.RunInfo { return runner.RunInfo{Shard: shard, Status: st} }
	runs := []runner.RunInfo{ // newest first
		r(0, runner.StatusRunning), r(0, runner.StatusFailed), r(1, runner.StatusFenced), r(0, runner.StatusSkipped),
		r(0, runner.StatusPanicked), r(1, runner.StatusSucceeded), r(0, runner.StatusSucceeded), r(0, runner.StatusFailed),
		r(2, runner.StatusFailed),
	}
	got := consecutiveFailures(runs, true)
	want := map[int]failures{0: {N: 2}, 1: {N: 1}, 2: {N: 1, AtLeast: true}}
	if len(got) != len(want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	for s, w := range want {
		if got[s] != w {
			t.Errorf("shard %d: %+v, want %+v", s, got[s], w)
		}
	}
	if got := consecutiveFailures(runs, false); got[2].AtLeast {
		t.Errorf("the whole ledger read: shard 2's streak is exact, got %+v", got[2])
	}
}

// The leadership timeline puts each term on its holder's lane, in time
// order, the term leading now reaching the right edge, and the fenced
// attempt on the stale holder's lane.
func TestLeadershipChart(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	at := func(m int) time.Time { return t0.Add(time.Duration(m) * time.Minute) }
	since := at(50)
	terms := []runner.Term{ // newest first, as Terms returns them
		{Token: 2, Holder: "n2", FirstRun: at(30), Until: at(40), Attempts: 2},
		{Token: 1, Holder: "n1", FirstRun: at(0), Until: at(20), Attempts: 3, Fenced: 1},
	}
	shards := []runner.JobInfo{{Job: "j", Leader: "n3", Token: 3, LeaderSince: &since}}
	fenced := []runner.RunInfo{{Token: 1, Holder: "n1", Status: runner.StatusFenced, StartedAt: at(31)}}
	c := leadershipChart(terms, shards, fenced, at(60))
	if len(c.Lanes) != 3 || c.Lanes[0].Label != "n1" || c.Lanes[2].Label != "n3" || len(c.Bars) != 3 || len(c.Marks) != 1 {
		t.Fatalf("chart: %+v", c)
	}
	b1, b2, b3 := c.Bars[0], c.Bars[1], c.Bars[2]
	if b1.X != chartLeft || !(b1.X+b1.W <= b2.X && b2.X+b2.W <= b3.X) || b3.X+b3.W != chartWidth-chartRight {
		t.Errorf("bars not in time order, or the current term not reaching now: %+v", c.Bars)
	}
	if b1.Y >= b2.Y || b2.Y >= b3.Y || b3.Class != "term term-current" || b1.Class != "term" {
		t.Errorf("bars not on their holders' lanes: %+v", c.Bars)
	}
	if m := c.Marks[0]; m.Y1 < c.Lanes[0].Y || m.Y2 > c.Lanes[0].LineY || !(m.X > b1.X+b1.W && m.X < b2.X+b2.W) {
		t.Errorf("fenced mark %+v not on n1's lane at minute 31", m)
	}
	// A recorded term is drawn from its start to its end, with why it
	// ended: here, a term with no attempt, ended by a rebalance.
	recorded := []runner.Term{{Token: 4, Holder: "n4", Started: at(10), Ended: at(15), EndCause: runner.EndMoved}}
	if c := leadershipChart(recorded, nil, nil, at(60)); len(c.Bars) != 1 || c.Bars[0].X != chartLeft ||
		!strings.Contains(c.Bars[0].Title, "ended: moved to another replica by a rebalance") {
		t.Errorf("a recorded term: %+v", c.Bars)
	}
	if empty := leadershipChart(nil, []runner.JobInfo{{Job: "j"}}, nil, at(60)); len(empty.Bars) != 0 || empty.Empty == "" {
		t.Errorf("no terms: %+v", empty)
	}
}

// A form value keeps the name exactly (it is posted back) with no raw
// control or format character in the page.
func TestValueOf(t *testing.T) {
	for _, name := range []string{"nightly-billing", "ctl\x1b[2Jname\u202e", `<"&'>`, "tab\tnew\nline"} {
		v := string(valueOf(name))
		inner := strings.TrimSuffix(strings.TrimPrefix(v, `value="`), `"`)
		if strings.ContainsAny(inner, "\x1b\u202e\t\n\"<>") {
			t.Errorf("valueOf(%q) = %s: raw characters", name, v)
		}
		if got := html.UnescapeString(inner); got != name {
			t.Errorf("valueOf(%q) reads back as %q", name, got)
		}
	}
}

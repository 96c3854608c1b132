package web

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/runner"
)

// Timelines drawn on the server as inline SVG, so that the page needs no
// script and no other origin to show them: the geometry is computed here,
// from what the database said, and the template only writes it out.

// chart is one timeline: a lane per instance (or per shard), bars on the
// lanes, marks across them, and a time axis below.
type chart struct {
	Label  string // what it shows, for screen readers
	Empty  string // what the page says instead when there is nothing to draw
	Width  float64
	Height float64
	Lanes  []chartLane
	Bars   []chartBar
	Marks  []chartMark
	Ticks  []chartTick
}

type chartLane struct {
	Label, Title string
	Y, TextY     float64
	LineY        float64
}

type chartBar struct {
	X, Y, W, H   float64
	Class        string
	Text         string // shown on the bar when it is wide enough
	TextX, TextY float64
	Title        string // the whole story, as the bar's tooltip
}

type chartMark struct {
	X, Y1, Y2 float64
	Title     string
}

type chartTick struct {
	X      float64
	Label  string
	Anchor string // the label's text-anchor: the end ticks stay inside the chart
}

// The charts' layout, in SVG user units (the SVG scales to the page).
const (
	chartWidth  = 960.0
	chartLeft   = 150.0 // the lanes' labels
	chartRight  = 12.0
	laneHeight  = 26.0
	barHeight   = 16.0
	axisHeight  = 22.0
	minBarWidth = 3.0
	textWidth   = 34.0 // the narrowest bar that carries its token as text
	laneLabel   = 20   // runes of a lane's label shown
	chartTicks  = 5
)

// timeScale maps times in [from, to] onto the chart's plotting width.
type timeScale struct{ from, to time.Time }

func (s timeScale) x(t time.Time) float64 {
	span := s.to.Sub(s.from)
	if span <= 0 {
		return chartLeft
	}
	f := float64(t.Sub(s.from)) / float64(span)
	return round1(chartLeft + min(max(f, 0), 1)*(chartWidth-chartLeft-chartRight))
}

func round1(f float64) float64 { return math.Round(f*10) / 10 }

// lanes lays out one lane per label, in the order given.
func (c *chart) lanes(labels []string) map[string]int {
	at := make(map[string]int, len(labels))
	for i, l := range labels {
		at[l] = i
		y := float64(i) * laneHeight
		shown := printable.String(l)
		if r := []rune(shown); len(r) > laneLabel {
			shown = string(r[:laneLabel-1]) + "…"
		}
		c.Lanes = append(c.Lanes, chartLane{Label: shown, Title: printable.String(l), Y: y,
			TextY: y + laneHeight/2 + 4, LineY: y + laneHeight})
	}
	c.Width, c.Height = chartWidth, float64(len(labels))*laneHeight+axisHeight
	return at
}

// axis adds evenly spaced time labels under the lanes.
func (c *chart) axis(s timeScale) {
	span := s.to.Sub(s.from)
	layout := "15:04:05"
	if span > 24*time.Hour {
		layout = "Jan 2 15:04"
	}
	for i := range chartTicks {
		t := s.from.Add(time.Duration(float64(span) * float64(i) / float64(chartTicks-1)))
		anchor := "middle"
		switch i {
		case 0:
			anchor = "start"
		case chartTicks - 1:
			anchor = "end"
		}
		c.Ticks = append(c.Ticks, chartTick{X: s.x(t), Label: t.UTC().Format(layout), Anchor: anchor})
	}
}

// bar adds a bar on lane from a to b.
func (c *chart) bar(s timeScale, lane int, a, b time.Time, class, text, title string) {
	x := s.x(a)
	w := max(s.x(b)-x, minBarWidth)
	if x+w > chartWidth-chartRight {
		x = chartWidth - chartRight - w // a bar at the right edge stays whole
	}
	y := float64(lane)*laneHeight + (laneHeight-barHeight)/2
	bar := chartBar{X: x, Y: y, W: round1(w), H: barHeight, Class: class, Title: title, TextX: x + 4, TextY: y + barHeight - 4}
	if w >= textWidth {
		bar.Text = text
	}
	c.Bars = append(c.Bars, bar)
}

// leadTerm is one term on the leadership timeline.
type leadTerm struct {
	shard    int
	token    fence.Token
	holder   string
	from, to time.Time
	attempts int
	fenced   int
	end      string // why it ended ("" while it goes on)
	current  bool   // the lease is held in this term now
}

// leadershipChart draws who led the job when: a lane per instance, a bar
// per term (from its start to its end, or to now for the term that leads
// now; from its first attempt to its last for a term whose record was
// pruned or missed) labelled with its token, why each ended in its title,
// and a red mark at each fenced attempt.
func leadershipChart(terms []runner.Term, shards []runner.JobInfo, fenced []runner.RunInfo, now time.Time) chart {
	c := chart{Label: "Leadership timeline: which instance held the job's lease when, with each term's fencing token; red marks are fenced attempts.",
		Empty: "No term yet: nothing has run, and no replica holds the job's lease."}
	sharded := len(shards) > 0 && shards[0].Shards > 0
	var all []leadTerm
	for _, t := range terms {
		from, to := t.Started, t.Ended
		if from.IsZero() { // a term known from the ledger only
			from = t.FirstRun
		}
		if to.IsZero() { // going on, or its leader died: its last sign of life
			to = maxTime(t.Until, from)
		}
		all = append(all, leadTerm{shard: t.Shard, token: t.Token, holder: t.Holder, from: from, to: to,
			attempts: t.Attempts, fenced: t.Fenced, end: t.Why()})
	}
	for _, ji := range shards {
		if ji.Leader == "" || ji.LeaderSince == nil {
			continue
		}
		i := slices.IndexFunc(all, func(t leadTerm) bool { return t.shard == ji.Shard && t.token == ji.Token })
		if i < 0 {
			all = append(all, leadTerm{shard: ji.Shard, token: ji.Token, holder: ji.Leader, from: *ji.LeaderSince})
			i = len(all) - 1
		}
		all[i].from = minTime(all[i].from, *ji.LeaderSince)
		all[i].to, all[i].current = now, true
	}
	if len(all) == 0 {
		return c
	}
	slices.SortFunc(all, func(a, b leadTerm) int { return cmp.Or(a.from.Compare(b.from), cmp.Compare(a.token, b.token)) })
	var holders []string
	for _, t := range all {
		if !slices.Contains(holders, t.holder) {
			holders = append(holders, t.holder)
		}
	}
	at := c.lanes(holders)
	s := timeScale{from: all[0].from, to: now}
	for _, t := range all {
		text := t.token.String()
		where := ""
		if sharded {
			text = fmt.Sprintf("#%d:%s", t.shard, t.token)
			where = fmt.Sprintf(" of shard %d", t.shard)
		}
		title := fmt.Sprintf("token %s%s, held by %s: from %s to %s, %d attempt(s)", t.token, where, printable.String(t.holder),
			t.from.UTC().Format(time.RFC3339), t.to.UTC().Format(time.RFC3339), t.attempts)
		class := "term"
		if t.current {
			title = fmt.Sprintf("token %s%s, held by %s since %s: leading now", t.token, where, printable.String(t.holder),
				t.from.UTC().Format(time.RFC3339))
			class = "term term-current"
		}
		if t.fenced > 0 {
			title += fmt.Sprintf(", %d fenced", t.fenced)
		}
		if t.end != "" {
			title += "; ended: " + t.end
		}
		c.bar(s, at[t.holder], t.from, t.to, class, text, title)
	}
	for _, ri := range fenced {
		lane, ok := at[ri.Holder]
		if !ok || ri.StartedAt.Before(s.from) {
			continue // its term is older than the timeline
		}
		y := float64(lane) * laneHeight
		c.Marks = append(c.Marks, chartMark{X: s.x(ri.StartedAt), Y1: y + 1, Y2: y + laneHeight - 1,
			Title: fmt.Sprintf("fenced: %s attempt %d with token %s on %s at %s: %s", ri.Kind, ri.Attempt, ri.Token,
				printable.String(ri.Holder), ri.StartedAt.UTC().Format(time.RFC3339), firstLine(ri.Error, errLine))})
	}
	c.axis(s)
	return c
}

// attemptsChart draws the attempts listed (newest first) as bars by
// duration and status: a lane per shard of a sharded job, one lane
// otherwise. A pending manual run has not started and is not drawn; a
// running attempt's bar reaches now.
func attemptsChart(runs []runner.RunInfo, shards int, now time.Time) chart {
	c := chart{Label: "Run timeline: each attempt listed below as a bar from its start to its end, coloured by status.",
		Empty: "No attempt to draw."}
	type span struct {
		ri       runner.RunInfo
		from, to time.Time
	}
	var spans []span
	for _, ri := range runs {
		if ri.Status == runner.StatusPending {
			continue
		}
		to := now
		if ri.FinishedAt != nil {
			to = *ri.FinishedAt
		}
		spans = append(spans, span{ri, ri.StartedAt, to})
	}
	if len(spans) == 0 {
		return c
	}
	s := timeScale{from: spans[0].from, to: spans[0].to}
	for _, sp := range spans {
		s.from, s.to = minTime(s.from, sp.from), maxTime(s.to, sp.to)
	}
	if s.to.Sub(s.from) < time.Second {
		s.to = s.from.Add(time.Second)
	}
	var labels []string
	label := func(shard int) string {
		if shards == 0 {
			return "attempts"
		}
		return fmt.Sprintf("shard %d", shard)
	}
	for _, sp := range spans {
		if l := label(sp.ri.Shard); !slices.Contains(labels, l) {
			labels = append(labels, l)
		}
	}
	slices.Sort(labels)
	at := c.lanes(labels)
	for _, sp := range spans {
		ri := sp.ri
		took := "still running"
		if ri.FinishedAt != nil {
			took = "in " + human(ri.Duration())
		}
		title := fmt.Sprintf("%s attempt %d of the %s slot: %s %s, token %s, on %s", ri.Kind, ri.Attempt,
			ri.Slot.UTC().Format(time.RFC3339), ri.Status, took, ri.Token, printable.String(ri.Holder))
		if ri.Error != "" {
			title += ": " + firstLine(ri.Error, errLine)
		}
		c.bar(s, at[label(ri.Shard)], sp.from, sp.to, "run run-"+string(ri.Status), "", title)
	}
	c.axis(s)
	return c
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

package runner

import (
	"context"
	"slices"
	"testing"
	"time"
)

// What a new leader runs after downtime, per Missed policy, for an interval
// schedule and for cron (which steps forward only): no database, no clock.
func TestCatchUp(t *testing.T) {
	at := func(h, m, s int) time.Time { return time.Date(2026, 12, 1, h, m, s, 0, time.UTC) }
	hourly := every(time.Hour)
	cronHourly, err := ParseSchedule("0 * * * *")
	if err != nil {
		t.Fatal(err)
	}
	for _, sched := range []struct {
		name string
		s    Schedule
	}{{"every", hourly}, {"cron", cronHourly}} {
		for _, tc := range []struct {
			name      string
			p         Missed
			last, now time.Time
			run       []time.Time
			unrun     int
		}{
			{"nothing missed", RunLatest, at(10, 0, 0), at(10, 59, 59), nil, 0},
			{"run-latest of ten", RunLatest, at(0, 0, 0), at(10, 30, 0), []time.Time{at(10, 0, 0)}, 9},
			{"skip of ten", Skip, at(0, 0, 0), at(10, 30, 0), nil, 10},
			{"skip inside the grace", Skip, at(0, 0, 0), at(10, 0, 0).Add(skipGrace - time.Nanosecond), []time.Time{at(10, 0, 0)}, 9},
			{"skip at the grace", Skip, at(0, 0, 0), at(10, 0, 0).Add(skipGrace), nil, 10},
			{"catch-up(3) of ten", CatchUp(3), at(0, 0, 0), at(10, 30, 0), []time.Time{at(8, 0, 0), at(9, 0, 0), at(10, 0, 0)}, 7},
			{"catch-up(20) of ten", CatchUp(20), at(0, 0, 0), at(10, 30, 0),
				[]time.Time{at(1, 0, 0), at(2, 0, 0), at(3, 0, 0), at(4, 0, 0), at(5, 0, 0), at(6, 0, 0), at(7, 0, 0), at(8, 0, 0), at(9, 0, 0), at(10, 0, 0)}, 0},
			{"catch-up(1) is run-latest", CatchUp(1), at(0, 0, 0), at(10, 30, 0), []time.Time{at(10, 0, 0)}, 9},
			{"a slot exactly now is due", CatchUp(2), at(8, 0, 0), at(10, 0, 0), []time.Time{at(9, 0, 0), at(10, 0, 0)}, 0},
		} {
			t.Run(sched.name+"/"+tc.name, func(t *testing.T) {
				run, unrun := catchUp(sched.s, tc.p, tc.last, tc.now)
				if !slices.EqualFunc(run, tc.run, time.Time.Equal) || unrun != tc.unrun {
					t.Fatalf("catchUp = %v, %d unrun; want %v, %d", run, unrun, tc.run, tc.unrun)
				}
			})
		}
	}
}

// After waiting for a slot, the runner runs it, or the latest slot due by
// then if the previous run overran several.
func TestOverrun(t *testing.T) {
	at := func(m, s int) time.Time { return time.Date(2026, 12, 1, 10, m, s, 0, time.UTC) }
	s := every(time.Minute)
	for _, tc := range []struct {
		next, now, slot time.Time
		missed          int
	}{
		{at(1, 0), at(1, 0), at(1, 0), 0},
		{at(1, 0), at(1, 59), at(1, 0), 0},
		{at(1, 0), at(2, 0), at(2, 0), 1},
		{at(1, 0), at(4, 30), at(4, 0), 3},
	} {
		slot, missed := overrun(s, tc.next, tc.now)
		if !slot.Equal(tc.slot) || missed != tc.missed {
			t.Errorf("overrun(next %v, now %v) = %v, %d; want %v, %d", tc.next, tc.now, slot, missed, tc.slot, tc.missed)
		}
	}
}

// Missed validates: RunLatest, Skip and CatchUp(1..MaxCatchUp), nothing
// else; each has a name for logs.
func TestMissedPolicies(t *testing.T) {
	for _, tc := range []struct {
		p    Missed
		ok   bool
		name string
	}{
		{RunLatest, true, "run-latest"}, {Skip, true, "skip"}, {CatchUp(1), true, "catch-up(1)"},
		{CatchUp(MaxCatchUp), true, "catch-up(1000)"}, {CatchUp(MaxCatchUp + 1), false, "Missed(1001)"},
		{Missed(-2), false, "Missed(-2)"},
	} {
		j := Job{Name: "j", Schedule: "@every 1m", Run: func(context.Context, *Run) error { return nil }, Missed: tc.p}
		_, err := j.validate()
		if (err == nil) != tc.ok || tc.p.String() != tc.name {
			t.Errorf("%v: validate() = %v, String() = %q; want ok %v, %q", int(tc.p), err, tc.p.String(), tc.ok, tc.name)
		}
	}
}

// The balancer applies a view at once when members only left, and a join
// once the view has held still for the settle interval, or after patience
// of continuous change.
func TestSettler(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	ms := func(d int) time.Time { return t0.Add(time.Duration(d) * time.Millisecond) }
	view := func(ids ...string) members { return members{"job": ids} }
	type step struct {
		view            members
		at              time.Time
		apply, settling bool
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"start-up settles first", []step{
			{view("a"), ms(0), false, true},
			{view("a"), ms(100), false, true},
			{view("a"), ms(250), true, false},
			{view("a"), ms(1250), false, false},
		}},
		{"a leave applies at once", []step{
			{view("a", "b"), ms(0), false, true},
			{view("a", "b"), ms(300), true, false},
			{view("a"), ms(400), true, false},
		}},
		{"joins one after another wait for stillness", []step{
			{view("a"), ms(0), false, true},
			{view("a"), ms(300), true, false},
			{view("a", "b"), ms(400), false, true},
			{view("a", "b", "c"), ms(600), false, true},
			{view("a", "b", "c"), ms(800), false, true},
			{view("a", "b", "c"), ms(850), true, false},
		}},
		{"continuous change applies after patience", []step{
			{view("a"), ms(0), false, true},
			{view("a", "b"), ms(200), false, true},
			{view("a", "b", "c"), ms(400), false, true},
			{view("a", "b", "c", "d"), ms(600), false, true},
			{view("a", "b", "c", "d", "e"), ms(1000), true, false},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := settler{settle: 250 * time.Millisecond, patience: time.Second}
			for i, st := range tc.steps {
				apply, settling := s.observe(st.view, st.at)
				if apply != st.apply || settling != st.settling {
					t.Fatalf("step %d (%v at %v): apply %v settling %v, want %v %v", i, st.view, st.at.Sub(t0), apply, settling, st.apply, st.settling)
				}
			}
		})
	}
}

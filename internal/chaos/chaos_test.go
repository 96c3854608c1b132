package chaos

import (
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// seedAndDuration reads CHAOS_SEED (replay) and CHAOS_DURATION (soak).
func seedAndDuration(t *testing.T, d time.Duration) (uint64, time.Duration) {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("CHAOS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("CHAOS_SEED=%q: %v", v, err)
		}
		seed = s
	}
	if v := os.Getenv("CHAOS_DURATION"); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil {
			t.Fatalf("CHAOS_DURATION=%q: %v", v, err)
		}
	}
	t.Logf("seed %d (replay: CHAOS_SEED=%d go test -run %s -v ./internal/chaos)", seed, seed, t.Name())
	return seed, d
}

// The bounded run: every kind of fault, at least 100 of each (crashes: 2),
// and no checker may find a violation.
func TestFaultSuite(t *testing.T) {
	seed, d := seedAndDuration(t, 80*time.Second)
	s := newSuite(t, config{seed: seed, duration: d, workers: 4, fenced: true, crashes: 2})
	s.run()
	r := s.check()
	t.Log(s.summary(r))
	for _, c := range r.crashTokens {
		t.Log("crash: " + c)
	}
	min := int64(100 * d / (80 * time.Second))
	for kind, n := range map[string]int64{"pauses": s.f.pauses.Load(), "kills": s.f.kills.Load(), "proxy": s.f.proxy.Load(), "clock": s.f.clock.Load()} {
		if n < min {
			t.Errorf("only %d %s faults (want >= %d)", n, kind, min)
		}
	}
	switch {
	case s.f.crashes.Load() < 2:
		t.Errorf("%d crashes, want 2", s.f.crashes.Load())
	case len(r.crashTokens) == 0:
		t.Error("no lease was acquired both before and after a crash: the crash check saw nothing")
	}
	if r.staleAccepted != 0 || r.failedApplied != 0 || r.regressions != 0 || r.crashRegressions != 0 || r.duplicates != 0 || r.lost != 0 || r.phantoms != 0 {
		t.Errorf("violations: stale_accepted=%d failed_applied=%d regressions=%d crash_regressions=%d duplicates=%d lost=%d phantom_acquisitions=%d",
			r.staleAccepted, r.failedApplied, r.regressions, r.crashRegressions, r.duplicates, r.lost, r.phantoms)
	}
	if r.linearizable != porcupine.Ok {
		t.Errorf("history is not linearizable (%v)", r.linearizable)
	}
	if r.accepted == 0 || r.staleRefused == 0 || r.slots == 0 {
		t.Errorf("the run exercised too little: accepted=%d stale_refused=%d nights=%d", r.accepted, r.staleRefused, r.slots)
	}
}

// The negative control: the same workload and faults with the fence switched
// off must be caught by the checkers, in every run.
func TestNegativeControlIsCaught(t *testing.T) {
	seed, _ := seedAndDuration(t, 0)
	s := newSuite(t, config{seed: seed, duration: 20 * time.Second, workers: 4, fenced: false})
	s.run()
	r := s.check()
	t.Log("unfenced: " + s.summary(r))
	if r.staleAccepted == 0 && r.duplicates == 0 {
		t.Fatal("the checkers did not catch the unfenced variant: stale_accepted=0 and duplicates=0")
	}
}

package lock_test

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/pgfence/pgfence/lock"
)

// A lease's JSON has its token as a decimal string and its durations in
// seconds, the shape `pgfence leases --json` and the status page share.
func TestInfoJSONShape(t *testing.T) {
	at := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	b, err := json.Marshal(lock.Info{Name: "nightly", Token: 9007199254740993, Holder: "a", Held: true,
		AcquiredAt: at, RenewedAt: at, ExpiresAt: at.Add(time.Second), ExpiresIn: 1500 * time.Millisecond, HeldFor: 2 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"name":"nightly","holder":"a","token":"9007199254740993","held":true,"acquired_at":"2026-12-02T10:00:00Z",` +
		`"renewed_at":"2026-12-02T10:00:00Z","expires_at":"2026-12-02T10:00:01Z","expires_in_seconds":1.5,"held_for_seconds":120}`
	if string(b) != want {
		t.Fatalf("got  %s\nwant %s", b, want)
	}
}

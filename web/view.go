package web

import (
	"fmt"
	"strings"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/internal/schemaver"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// What the pages show, computed from what the database said: no I/O here.

// leaseState classifies a lease for the page.
type leaseState string

const (
	stateFree    leaseState = "free"
	stateHeld    leaseState = "held"
	stateEnding  leaseState = "ending"  // held, but a renewal is overdue
	stateExpired leaseState = "expired" // expired and not released
)

// stateOf classifies i: free (no holder), expired (a holder, past
// ExpiresAt by the database's clock: it neither renewed nor released),
// ending (held, with less than a third of its TTL left, so at least one
// renewal is overdue: a holder renews at least every TTL/2, and stops
// trusting the lease before ExpiresAt) or held.
func stateOf(i lock.Info) leaseState {
	switch {
	case i.Holder == "":
		return stateFree
	case !i.Held || i.ExpiresIn <= 0:
		return stateExpired
	case i.ExpiresIn*3 < i.ExpiresAt.Sub(i.RenewedAt):
		return stateEnding
	}
	return stateHeld
}

// Text says what a state means, for people and screen readers.
func (s leaseState) Text() string {
	switch s {
	case stateFree:
		return "free"
	case stateExpired:
		return "expired, not released"
	case stateEnding:
		return "renewal overdue"
	}
	return "held"
}

// epochText names the history a token was issued in: the current one
// (tokens from its first token on) or an earlier one.
func epochText(tok fence.Token, e *schemaver.Epoch) string {
	switch {
	case e == nil || tok == 0:
		return ""
	case int64(tok) >= e.FirstToken:
		return fmt.Sprintf("timeline %d", e.Timeline)
	}
	return fmt.Sprintf("before timeline %d", e.Timeline)
}

// human writes a duration the way the pages show it: 850ms, 3.2s, 4m05s,
// 3h04m, 2d03h. Negative durations get a minus sign.
func human(d time.Duration) string {
	if d < 0 {
		return "-" + human(-d)
	}
	switch {
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	case d < 10*time.Second:
		return fmt.Sprintf("%.1fs", d.Seconds())
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}

// firstLine is the first line of an error message, made visible, at most
// n runes (with "…" when cut).
func firstLine(s string, n int) string {
	line, _, more := strings.Cut(s, "\n")
	line = printable.String(line)
	if r := []rune(line); len(r) > n {
		return string(r[:n]) + "…"
	} else if more {
		return line + " …"
	}
	return line
}

// stands reports a status that should stand out on the page.
func stands(s runner.Status) bool {
	return s == runner.StatusFailed || s == runner.StatusPanicked || s == runner.StatusFenced
}

// shardLabel names a job's shard: "" for an unsharded job, "#N" otherwise.
func shardLabel(shards, shard int) string {
	if shards == 0 {
		return ""
	}
	return fmt.Sprintf("#%d", shard)
}

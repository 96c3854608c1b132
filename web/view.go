package web

import (
	"cmp"
	"fmt"
	"html"
	"html/template"
	"slices"
	"strconv"
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

// firstLine is the first line of an error message, shown as text, at most
// n runes (with "…" when cut).
func firstLine(s string, n int) string {
	line, _, more := strings.Cut(s, "\n")
	line = printable.Text(line)
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

// scheduleWords says a job's schedule in words for the common forms
// (@every, the @ shorthands, a daily, weekly or hourly cron line, every N
// minutes or hours), naming the time zone cron lines are read in; any
// other cron line is given as it is, with its zone. The next slots, which
// the page lists beside it, say the rest.
func scheduleWords(spec string) string {
	zone := "UTC"
	rest := strings.TrimSpace(spec)
	if strings.HasPrefix(rest, "CRON_TZ=") || strings.HasPrefix(rest, "TZ=") {
		prefix, r, _ := strings.Cut(rest, " ")
		_, zone, _ = strings.Cut(prefix, "=")
		rest = strings.TrimSpace(r)
	}
	if d, ok := strings.CutPrefix(rest, "@every "); ok {
		return "every " + strings.TrimSpace(d)
	}
	switch rest {
	case "@hourly":
		return "every hour, on the hour"
	case "@daily", "@midnight":
		return "every day at 00:00 " + zone
	case "@weekly":
		return "every Sunday at 00:00 " + zone
	case "@monthly":
		return "on the 1st of every month at 00:00 " + zone
	case "@yearly", "@annually":
		return "every 1 January at 00:00 " + zone
	}
	f := strings.Fields(rest)
	if len(f) != 5 {
		return "cron " + rest + " (" + zone + ")"
	}
	minute, hour, dom, month, dow := f[0], f[1], f[2], f[3], f[4]
	num := func(s string, hi int) (int, bool) {
		n, err := strconv.Atoi(s)
		return n, err == nil && n >= 0 && n <= hi
	}
	m, mOK := num(minute, 59)
	h, hOK := num(hour, 23)
	anyDay := dom == "*" && month == "*"
	days := map[string]string{"*": "every day", "1-5": "on weekdays", "0,6": "on weekends", "6,0": "on weekends",
		"0": "every Sunday", "1": "every Monday", "2": "every Tuesday", "3": "every Wednesday", "4": "every Thursday",
		"5": "every Friday", "6": "every Saturday", "7": "every Sunday"}
	switch {
	case anyDay && mOK && hOK && days[dow] != "":
		return fmt.Sprintf("%s at %02d:%02d %s", days[dow], h, m, zone)
	case anyDay && dow == "*" && mOK && hour == "*":
		return fmt.Sprintf("every hour at minute %d", m)
	case anyDay && dow == "*" && minute == "*" && hour == "*":
		return "every minute"
	case anyDay && dow == "*" && hour == "*" && strings.HasPrefix(minute, "*/"):
		if n, ok := num(minute[2:], 59); ok && n > 0 {
			return fmt.Sprintf("every %d minutes", n)
		}
	case anyDay && dow == "*" && mOK && strings.HasPrefix(hour, "*/"):
		if n, ok := num(hour[2:], 23); ok && n > 0 {
			return fmt.Sprintf("every %d hours at minute %d (%s)", n, m, zone)
		}
	}
	return "cron " + rest + " (" + zone + ")"
}

// sortLeases puts the leases someone holds (or held and never released)
// first, then the free ones, each by name.
func sortLeases(rows []leaseRow) {
	slices.SortStableFunc(rows, func(a, b leaseRow) int {
		return cmp.Or(cmp.Compare(boolRank(a.State == stateFree), boolRank(b.State == stateFree)), strings.Compare(a.Name, b.Name))
	})
}

func boolRank(b bool) int {
	if b {
		return 1
	}
	return 0
}

// valueOf writes a form field's value attribute holding s exactly (the
// form posts it back) with no raw control or format character in the
// page: those are written as character references (&#x1b;), as the HTML
// escapes are, so the page's source shows them as the text does.
func valueOf(s string) template.HTMLAttr {
	var b strings.Builder
	b.WriteString(`value="`)
	for _, r := range s {
		switch {
		case r == '\x00':
			b.WriteString("&#xfffd;")
		case strconv.IsPrint(r) && r != '\u00a0':
			b.WriteString(html.EscapeString(string(r)))
		default:
			fmt.Fprintf(&b, "&#x%x;", r)
		}
	}
	b.WriteString(`"`)
	return template.HTMLAttr(b.String())
}

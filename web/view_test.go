package web

import (
	"testing"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

func TestStateOf(t *testing.T) {
	at := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	lease := func(holder string, held bool, ttl, left time.Duration) lock.Info {
		return lock.Info{Holder: holder, Held: held, RenewedAt: at, ExpiresAt: at.Add(ttl), ExpiresIn: left}
	}
	for _, c := range []struct {
		name string
		in   lock.Info
		want leaseState
	}{
		{"free", lease("", false, 15*time.Second, -time.Hour), stateFree},
		{"just renewed", lease("a", true, 15*time.Second, 15*time.Second), stateHeld},
		{"due for renewal at TTL/2", lease("a", true, 15*time.Second, 7500*time.Millisecond), stateHeld},
		{"a renewal overdue", lease("a", true, 15*time.Second, 4*time.Second), stateEnding},
		{"expired, not released", lease("a", false, 15*time.Second, -time.Second), stateExpired},
		{"held flag stale, expiry passed", lease("a", true, 15*time.Second, 0), stateExpired},
	} {
		if got := stateOf(c.in); got != c.want {
			t.Errorf("%s: stateOf = %s, want %s", c.name, got, c.want)
		}
	}
}

func TestEpochText(t *testing.T) {
	e := &migrations.Epoch{Timeline: 3, FirstToken: 100}
	for _, c := range []struct {
		tok  int64
		e    *migrations.Epoch
		want string
	}{
		{150, e, "timeline 3"},
		{100, e, "timeline 3"},
		{99, e, "before timeline 3"},
		{5, nil, ""},
		{0, e, ""},
	} {
		if got := epochText(fence.Token(c.tok), c.e); got != c.want {
			t.Errorf("epochText(%d) = %q, want %q", c.tok, got, c.want)
		}
	}
}

func TestHuman(t *testing.T) {
	for d, want := range map[time.Duration]string{
		850 * time.Millisecond:              "850ms",
		3200 * time.Millisecond:             "3.2s",
		42 * time.Second:                    "42s",
		4*time.Minute + 5*time.Second:       "4m05s",
		3*time.Hour + 4*time.Minute:         "3h04m",
		51 * time.Hour:                      "2d03h",
		-1500 * time.Millisecond:            "-1.5s",
		0:                                   "0ms",
		59*time.Minute + 59*time.Second:     "59m59s",
		23*time.Hour + 59*time.Minute + 1e9: "23h59m",
	} {
		if got := human(d); got != want {
			t.Errorf("human(%v) = %q, want %q", d, got, want)
		}
	}
}

func TestFirstLine(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{
		{"boom", 10, "boom"},
		{"boom\nstack", 10, "boom …"},
		{"0123456789abc", 10, "0123456789…"},
		{"bell\x07", 20, `bell\a`},
		{`held by "n2"`, 20, `held by "n2"`}, // quotes as written
	} {
		if got := firstLine(c.in, c.n); got != c.want {
			t.Errorf("firstLine(%q, %d) = %q, want %q", c.in, c.n, got, c.want)
		}
	}
}

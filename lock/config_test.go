package lock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/lock"
)

// The connection string is checked against the lease timings (no database
// needed: a pool connects lazily).
func TestNewChecksTheConnectionString(t *testing.T) {
	const hosts = "postgres://u@127.0.0.1:54401,127.0.0.1:54402,127.0.0.1:54403/db?sslmode=disable"
	cases := []struct {
		name, url string
		cfg       lock.Config
		ok        bool
	}{
		{"one host, no timeout", "postgres://u@127.0.0.1:5432/db?sslmode=disable", lock.Config{}, true},
		// sslmode=prefer gives each host two configs (TLS, then plain): still one host.
		{"one host, sslmode=prefer", "postgres://u@127.0.0.1:5432/db?sslmode=prefer", lock.Config{}, true},
		{"multi-host, sslmode=prefer, without target_session_attrs",
			"postgres://u@127.0.0.1:54401,127.0.0.1:54402/db?sslmode=prefer&connect_timeout=2", lock.Config{}, false},
		{"multi-host as documented", hosts + "&target_session_attrs=read-write&connect_timeout=2", lock.Config{}, true},
		{"multi-host, primary", hosts + "&target_session_attrs=primary&connect_timeout=2", lock.Config{}, true},
		{"multi-host without target_session_attrs", hosts + "&connect_timeout=2", lock.Config{}, false},
		{"multi-host without connect_timeout", hosts + "&target_session_attrs=read-write", lock.Config{}, false},
		// TTL 3s: renewal budget 3 - 0.3 - 1 = 1.7s < connect_timeout 2s.
		{"connect_timeout beyond the renewal budget", hosts + "&target_session_attrs=read-write&connect_timeout=2",
			lock.Config{TTL: 3 * time.Second}, false},
		{"connect_timeout inside the renewal budget", hosts + "&target_session_attrs=read-write&connect_timeout=2",
			lock.Config{TTL: 5 * time.Second}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pool, err := pgxpool.New(context.Background(), tc.url)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			c, err := lock.New(pool, tc.cfg)
			var ce *lock.ConfigError
			switch {
			case tc.ok && err != nil:
				t.Fatalf("New: %v", err)
			case !tc.ok && (!errors.As(err, &ce) || !errors.Is(err, lock.ErrInvalidConfig)):
				t.Fatalf("New: %v, want a *ConfigError", err)
			case !tc.ok:
				t.Logf("refused: %v", err)
			}
			if c != nil {
				_ = c.Close(context.Background())
			}
		})
	}
}

// Timings that cannot work are refused, naming the field: below MinTTL a
// lease cannot outlive the renewal round trip that keeps it.
func TestNewRefusesTimingsBelowTheFloors(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://u@127.0.0.1:5432/db?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for _, tc := range []struct {
		cfg   lock.Config
		field string
	}{
		{lock.Config{TTL: time.Millisecond}, "TTL"},
		{lock.Config{TTL: lock.MinTTL - time.Millisecond}, "TTL"},
		{lock.Config{TTL: -time.Second}, "TTL"},
	} {
		c, err := lock.New(pool, tc.cfg)
		var ce *lock.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field {
			t.Errorf("New(%+v) = %v; want a *ConfigError for %s", tc.cfg, err, tc.field)
		}
		if c != nil {
			_ = c.Close(context.Background())
		}
	}
	c, err := lock.New(pool, lock.Config{TTL: lock.MinTTL})
	if err != nil {
		t.Fatalf("New with TTL = MinTTL: %v", err)
	}
	_ = c.Close(context.Background())
}

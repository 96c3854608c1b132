package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// pgfence roles lists each partition of a running role with its leader,
// token, position and commits, as a table and as JSON, and exits 4 for a
// role that has never had a leader.
func TestRolesListsPartitions(t *testing.T) {
	c := newCLI(t)
	pool := pgtest.NewPool(t, "cli-roles")
	client, err := lock.New(pool, lock.Config{Schema: c.schema, Holder: "relay-a", Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close(context.Background())
	r, err := runner.New(client, runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	// Each partition commits position 7 once, then waits.
	err = r.RegisterRole(runner.Role{Name: "relay", Partitions: 2, Lead: func(ctx context.Context, p *runner.Partition) error {
		if p.Position() == 0 {
			if err := p.Commit(ctx, func(context.Context, pgx.Tx) (int64, error) { return 7, nil }); err != nil {
				return err
			}
		}
		return p.Wait(ctx)
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	var parts []map[string]any
	pgtest.Eventually(t, 30*time.Second, "both partitions at position 7", func() bool {
		out, code := c.run("", "roles", "--json")
		if code != 0 || json.Unmarshal([]byte(out), &parts) != nil || len(parts) != 2 {
			return false
		}
		return parts[0]["position"] == "7" && parts[1]["position"] == "7"
	})
	for i, p := range parts {
		if p["role"] != "relay" || p["partition"] != float64(i) || p["leader"] != "relay-a" || p["leading"] != true || p["commits"] != float64(1) {
			t.Fatalf("roles --json partition %d: %v", i, p)
		}
	}
	out, code := c.run("", "roles", "relay")
	if code != 0 || !strings.Contains(out, "ROLE") || strings.Count(out, "relay-a") != 2 {
		t.Fatalf("roles relay: exit %d\n%s", code, out)
	}
	if out, code := c.run("", "roles", "nope"); code != exitNoJob {
		t.Fatalf("roles nope: exit %d, want %d\n%s", code, exitNoJob, out)
	}
}

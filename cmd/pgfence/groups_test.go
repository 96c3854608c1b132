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

// pgfence groups lists each partition of a running consumer group with its
// leader, token, offset and commits, as a table and as JSON, and exits 4
// for a group that has never had a leader; pgfence groups seek sets an
// offset, and the next leader resumes there.
func TestGroupsListsPartitionsAndSeeks(t *testing.T) {
	c := newCLI(t)
	pool := pgtest.NewPool(t, "cli-groups")
	client, err := lock.New(pool, lock.Config{Schema: c.schema, Holder: "relay-a", Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close(context.Background())
	r, err := runner.New(client, runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	// Each partition commits offset 7 once, then waits.
	err = r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 2, Consume: func(ctx context.Context, p *runner.Partition) error {
		if p.Offset() == 0 {
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
	pgtest.Eventually(t, 30*time.Second, "both partitions at offset 7", func() bool {
		out, code := c.run("", "groups", "--json")
		if code != 0 || json.Unmarshal([]byte(out), &parts) != nil || len(parts) != 2 {
			return false
		}
		return parts[0]["offset"] == "7" && parts[1]["offset"] == "7"
	})
	for i, p := range parts {
		if p["group"] != "relay" || p["partition"] != float64(i) || p["leader"] != "relay-a" || p["leading"] != true || p["commits"] != float64(1) {
			t.Fatalf("groups --json partition %d: %v", i, p)
		}
	}
	out, code := c.run("", "groups", "relay")
	if code != 0 || !strings.Contains(out, "GROUP") || !strings.Contains(out, "OFFSET") || strings.Count(out, "relay-a") != 2 {
		t.Fatalf("groups relay: exit %d\n%s", code, out)
	}
	if out, code := c.run("", "groups", "nope"); code != exitNoJob {
		t.Fatalf("groups nope: exit %d, want %d\n%s", code, exitNoJob, out)
	}
	// A seek back to 3 on partition 1: its leader's term is revoked, and
	// the next term starts there (and, at 3, does not commit 7 again).
	if out, code := c.run("", "groups", "seek", "relay", "1", "3", "--yes"); code != 0 || !strings.Contains(out, "offset 7 -> 3") {
		t.Fatalf("groups seek: exit %d\n%s", code, out)
	}
	pgtest.Eventually(t, 30*time.Second, "partition 1 led again from offset 3", func() bool {
		out, code := c.run("", "groups", "relay", "--json")
		if code != 0 || json.Unmarshal([]byte(out), &parts) != nil || len(parts) != 2 {
			return false
		}
		return parts[1]["offset"] == "3" && parts[1]["leading"] == true && parts[1]["committer"] != "relay-a"
	})
	if out, code := c.run("", "groups", "seek", "relay", "5", "0", "--yes"); code != exitNoJob {
		t.Fatalf("groups seek of a partition never led: exit %d, want %d\n%s", code, exitNoJob, out)
	}
	// The count changed while the replica runs: through the cut, to 3.
	if out, code := c.run("", "groups", "partitions", "relay", "3"); code != 0 || !strings.Contains(out, "changing from 2 to 3 partitions at offset 7") {
		t.Fatalf("groups partitions: exit %d\n%s", code, out)
	}
	if out, code := c.run("", "groups", "partitions", "nope", "3"); code != exitNoJob {
		t.Fatalf("groups partitions of an unknown group: exit %d, want %d\n%s", code, exitNoJob, out)
	}
	if out, code := c.run("", "groups", "seek", "relay", "1", "-2", "--yes"); code != exitUsage {
		t.Fatalf("groups seek to a negative offset: exit %d, want %d\n%s", code, exitUsage, out)
	}
}

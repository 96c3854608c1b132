package main

import (
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The example exports every instrument it touched.
func TestMetricsExample(t *testing.T) {
	db := pgtest.New(t)
	var out strings.Builder
	if err := run(pgtest.Context(t, time.Minute), db.Pool, db.Schema, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"pgfence.lease.acquisitions{pgfence.outcome=acquired} 2",
		"pgfence.lease.renewal.duration", "pgfence.lease.time_left", "pgfence.lease.held",
		"pgfence.guard.transactions{pgfence.outcome=committed} 1",
		"pgfence.runner.runs{pgfence.job=metrics-example,pgfence.outcome=succeeded}",
		"pgfence.runner.leadership.changes{pgfence.change=gained,pgfence.job=metrics-example} 1",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	t.Logf("\n%s", out.String())
}

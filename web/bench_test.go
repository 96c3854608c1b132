package web_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/web"
)

// BenchmarkPages measures each page's server time (the handler, its
// statements and the rendering) with 10,000 attempts in the ledger: ten
// jobs of 1,000 attempts each, a tenth of them failed, over 100 terms, and
// 200 leases.
//
//	go test -run '^$' -bench Pages ./web
func BenchmarkPages(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	for _, q := range []string{
		`INSERT INTO ` + db.Schema + `.pgfence_jobs (job, schedule, shards, max_attempts, registered_at, registered_by)
		 SELECT 'job-' || j, '@every 1m', 0, 3, now(), 'n0' FROM generate_series(0, 9) j`,
		`INSERT INTO ` + db.Schema + `.pgfence_runs (job, shard, kind, slot, attempt, token, status, holder, started_at, finished_at, error)
		 SELECT 'job-' || (i % 10), 0, 'scheduled', now() - (i / 10) * interval '1 minute', 1, 1 + i / 100,
		        CASE WHEN i % 10 = 3 THEN 'failed' ELSE 'succeeded' END, 'n' || ((i / 100) % 4),
		        now() - (i / 10) * interval '1 minute', now() - (i / 10) * interval '1 minute' + interval '2 seconds',
		        CASE WHEN i % 10 = 3 THEN 'boom' END
		   FROM generate_series(0, 9999) i`,
		`WITH s AS (INSERT INTO ` + db.Schema + `.pgfence_sessions (holder, started_at, renewed_at, expires_at)
		            VALUES ('n0', now(), now(), now() + interval '1 minute') RETURNING id)
		 INSERT INTO ` + db.Schema + `.pgfence_leases (name, holder, secret, session, acquired_at)
		 SELECT 'lease-' || i, CASE WHEN i % 2 = 0 THEN 'n0' END, CASE WHEN i % 2 = 0 THEN '\x01'::bytea END,
		        CASE WHEN i % 2 = 0 THEN s.id END, now()
		   FROM generate_series(0, 199) i, s`,
	} {
		if _, err := db.Pool.Exec(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	h, err := web.New(db.Pool, web.Config{Schema: db.Schema})
	if err != nil {
		b.Fatal(err)
	}
	for _, path := range []string{"/", "/jobs", "/fleet", "/job?name=job-3", "/job?name=job-3&status=failed&page=3"} {
		b.Run(fmt.Sprintf("page=%s", path), func(b *testing.B) {
			for b.Loop() {
				rec := httptest.NewRecorder()
				req := httptest.NewRequest(http.MethodGet, path, nil)
				req.Host = "localhost"
				h.ServeHTTP(rec, req)
				if rec.Code != http.StatusOK {
					b.Fatalf("%s: %d\n%s", path, rec.Code, rec.Body)
				}
			}
		})
	}
}

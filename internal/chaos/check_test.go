package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/linear"
)

// result is what the checkers found.
type result struct {
	attempted, accepted, staleRefused, unknown int
	staleAccepted                              int
	failed, failedApplied                      int // writes RunTx reported not committed, and those that were
	regressions                                int
	phantoms                                   int // tokens issued to a worker that no attempt of it explains
	lostReplies                                int // acquisitions whose reply was lost inside a blocking Acquire
	duplicates, lost, slots                    int
	linearizable                               porcupine.CheckResult
	crashTokens                                []string
	crashRegressions                           int
}

func (s *suite) summary(r result) string {
	lin := map[porcupine.CheckResult]string{porcupine.Ok: "yes", porcupine.Illegal: "NO", porcupine.Unknown: "unknown (timeout)"}[r.linearizable]
	return fmt.Sprintf("faults: pauses=%d kills=%d proxy=%d clock=%d crashes=%d | writes: attempted=%d accepted=%d stale_refused=%d failed=%d unknown=%d stale_accepted=%d failed_applied=%d | tokens: regressions=%d lost_replies=%d | ledger: nights=%d duplicates=%d lost=%d | linearizable=%s | seed=%d",
		s.f.pauses.Load(), s.f.kills.Load(), s.f.proxy.Load(), s.f.clock.Load(), s.f.crashes.Load(),
		r.attempted, r.accepted, r.staleRefused, r.failed, r.unknown, r.staleAccepted, r.failedApplied, r.regressions+r.crashRegressions, r.lostReplies,
		r.slots, r.duplicates, r.lost, lin, s.cfg.seed)
}

type acq struct {
	id     int64
	name   string
	token  int64
	holder string
	at     time.Time
}

// check runs every checker over the history and the database.
func (s *suite) check() result {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var r result
	q := func(sql string, args ...any) int {
		var n int
		if err := s.admin.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			s.t.Fatalf("%s: %v", sql, err)
		}
		return n
	}
	rows, err := s.admin.Query(ctx, "SELECT id, name, token, coalesce(holder, ''), at FROM data.acq_log ORDER BY id")
	if err != nil {
		s.t.Fatal(err)
	}
	acqs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (acq, error) {
		var a acq
		return a, row.Scan(&a.id, &a.name, &a.token, &a.holder, &a.at)
	})
	if err != nil {
		s.t.Fatal(err)
	}

	// Tokens: per lease, in commit order, strictly increasing; and across
	// each crash, the first token after the restart is above every token
	// issued before the crash.
	last := map[string]int64{}
	for _, a := range acqs {
		if a.token <= last[a.name] {
			r.regressions++
		}
		last[a.name] = a.token
	}
	for _, c := range s.crashes {
		before, after := map[string]int64{}, map[string]int64{}
		for _, a := range acqs {
			switch {
			case a.at.Before(c.at):
				before[a.name] = max(before[a.name], a.token)
			case a.at.After(c.restarted):
				if _, ok := after[a.name]; !ok {
					after[a.name] = a.token
				}
			}
		}
		for name, b := range before {
			if aft, ok := after[name]; ok {
				r.crashTokens = append(r.crashTokens, fmt.Sprintf("%s: last before crash %d, first after restart %d", name, b, aft))
				if aft <= b {
					r.crashRegressions++
				}
			}
		}
	}

	// Stale writes accepted: a committed write (or charge) whose token is
	// below a token issued before it was written, by the server's clock.
	r.staleAccepted = q(`SELECT count(*) FROM data.write_log w WHERE w.token < (SELECT max(token) FROM data.acq_log a
		WHERE a.name = $1 AND a.at < w.at)`, register) +
		q(`SELECT count(*) FROM data.charges c WHERE c.token < (SELECT max(token) FROM data.acq_log a
		WHERE a.name = $1 AND a.at < c.at)`, "pgfence/job/"+chargeJob)

	// Ledger: each customer charged at most once per night; every night the
	// ledger says succeeded has all its charges.
	r.duplicates = q("SELECT count(*) FROM (SELECT 1 FROM data.charges GROUP BY customer, night HAVING count(*) > 1) d")
	r.slots = q("SELECT count(*) FROM pgfence.pgfence_runs WHERE job = $1 AND status = 'succeeded'", chargeJob)
	r.lost = q(`SELECT count(*) FROM pgfence.pgfence_runs r WHERE r.job = $1 AND r.status = 'succeeded'
		AND (SELECT count(DISTINCT customer) FROM data.charges WHERE night = r.slot) < $2`, chargeJob, customers)

	// The register's history, with unknown outcomes resolved from the
	// database where they can be: a write happened iff its unique value is
	// in the log; an acquisition happened iff the log has a token for that
	// worker that no acknowledged acquisition of it reported.
	applied := map[int64]bool{}
	vrows, err := s.admin.Query(ctx, "SELECT value FROM data.write_log")
	if err != nil {
		s.t.Fatal(err)
	}
	vals, err := pgx.CollectRows(vrows, pgx.RowTo[int64])
	if err != nil {
		s.t.Fatal(err)
	}
	for _, v := range vals {
		applied[v] = true
	}
	hist := s.histories()
	sort.Slice(hist, func(i, j int) bool { return hist[i].Call < hist[j].Call })
	reported := map[string]bool{}
	for _, h := range hist {
		if h.Kind == "acquire" && h.Out == "ok" {
			reported[fmt.Sprintf("w%d/%d", h.Worker, h.Token)] = true
		}
	}
	unexplained := map[string][]acq{} // holder -> tokens nobody reported
	for _, a := range acqs {
		if a.name == register && !reported[fmt.Sprintf("%s/%d", a.holder, a.token)] {
			unexplained[a.holder] = append(unexplained[a.holder], a)
		}
	}
	bound := int64(opBound)
	rec := linear.NewRecorder()
	for _, h := range hist {
		in, out := linear.Input{Token: h.Token, Value: h.Value}, linear.Output{Token: h.Token, Value: h.Value}
		ret := h.Ret
		switch h.Kind {
		case "acquire":
			in.Kind = linear.Acquire
			if h.Out == "unknown" {
				// Match the earliest unexplained token of this worker
				// issued within the attempt's window.
				list := unexplained[fmt.Sprintf("w%d", h.Worker)]
				found := -1
				for i, a := range list {
					if t := a.at.UnixNano(); t >= h.Call && t <= h.Ret+bound {
						found = i
						break
					}
				}
				if found < 0 {
					continue // not granted: no effect
				}
				out.Token = list[found].token
				ret = h.Ret + bound
				unexplained[fmt.Sprintf("w%d", h.Worker)] = append(list[:found], list[found+1:]...)
			}
		case "write":
			in.Kind = linear.Write
			r.attempted++
			switch h.Out {
			case "ok":
				out.OK = true
				r.accepted++
			case "refused":
				r.staleRefused++
			case "failed":
				r.failed++
				if applied[h.Value] {
					r.failedApplied++
					s.t.Logf("write %d reported not committed but committed: %s", h.Value, h.Err)
				}
				continue // did not commit: no effect
			default:
				r.unknown++
				if !applied[h.Value] {
					continue // did not commit: no effect
				}
				out.OK = true
				r.accepted++
				ret = h.Ret + bound
			}
		case "read":
			in.Kind = linear.Read
		}
		rec.AddAt(h.Worker, h.Call, ret, in, out)
	}
	// A token left unexplained may come from an inner attempt of a blocking
	// Acquire: its reply was lost (connection killed after the commit), the
	// call retried and returned a later token. Such an acquisition happened
	// within that call's window. Only a token outside every attempt of its
	// worker is a phantom.
	for holder, list := range unexplained {
		for _, a := range list {
			t, found := a.at.UnixNano(), false
			for _, h := range hist {
				if h.Kind != "acquire" || fmt.Sprintf("w%d", h.Worker) != holder {
					continue
				}
				end := h.Ret
				if h.Out == "unknown" {
					end += bound
				}
				if t >= h.Call && t <= end {
					rec.AddAt(h.Worker, h.Call, end, linear.Input{Kind: linear.Acquire}, linear.Output{Token: a.token})
					found = true
					r.lostReplies++
					break
				}
			}
			if !found {
				r.phantoms++
			}
		}
	}
	r.linearizable = rec.Check(3 * time.Minute)
	if r.linearizable == porcupine.Illegal && s.cfg.fenced {
		path := filepath.Join(os.TempDir(), fmt.Sprintf("pgfence-chaos-seed-%d.html", s.cfg.seed))
		if _, err := rec.Explain(time.Minute, path); err == nil {
			s.t.Logf("linearizability counterexample: %s", path)
		}
	}
	return r
}

package runner

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
)

// The kinds of lease whose terms pgfence_terms records.
const (
	termJob   = "job"
	termGroup = "group"
)

// termWrite bounds the statements that record a term's start and end:
// they are a record for operators, and must not hold up a term's work nor
// its lease's release for long when the database is slow or cut off.
const termWrite = 2 * time.Second

// prevTerm is the term before this one, as its start found it.
type prevTerm struct {
	holder string
	token  fence.Token
	cause  string
}

// kind is the worker's kind of lease in pgfence_terms.
func (w *worker) kind() string {
	if w.j.group != nil {
		return termGroup
	}
	return termJob
}

// startTerm records the start of l's term and returns the term before it
// (zero if none or unknown). A failure is logged, not returned: the term's
// work does not depend on its record.
func (w *worker) startTerm(l *lock.Lease) prevTerm {
	ctx, cancel := context.WithTimeout(l.Context(), termWrite)
	defer cancel()
	var (
		p   prevTerm
		tok int64
	)
	err := w.r.pool.QueryRow(ctx, w.r.q.termStart, w.kind(), w.j.Name, w.shard, int64(l.Token()), w.r.lcfg.Holder).
		Scan(&p.holder, &tok, &p.cause)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return prevTerm{}
	case err != nil:
		if l.Context().Err() == nil {
			w.log().Warn("pgfence runner: recording the start of a term failed; the terms shown to operators miss it",
				"token", l.Token(), "err", err)
		}
		return prevTerm{}
	}
	p.token = fence.Token(tok)
	return p
}

// endTerm records why l's term ended, unless the next leader already has.
// It runs before the lease is released, on its own bound (the term's
// context has ended): termWrite, and at most half of ShutdownTimeout, so
// that recording the end never makes a shutdown late; within ctx.
func (w *worker) endTerm(ctx context.Context, l *lock.Lease, cause string) {
	ctx, cancel := context.WithTimeout(ctx, min(termWrite, w.r.cfg.ShutdownTimeout/2))
	defer cancel()
	if _, err := w.r.pool.Exec(ctx, w.r.q.termEnd, w.kind(), w.j.Name, w.shard, int64(l.Token()), cause); err != nil {
		w.log().Warn("pgfence runner: recording the end of a term failed; the next leader records it as expired",
			"token", l.Token(), "why", cause, "err", err)
	}
}

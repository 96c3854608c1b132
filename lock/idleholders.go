package lock

import (
	"context"
	"errors"
	"time"

	"github.com/pgfence/pgfence/internal/idleholder"
)

// forceReleaseIdleAfter is ForceRelease's Config.IdleHolderAfter: the
// default with the defaults.
const forceReleaseIdleAfter = 250 * time.Millisecond

// watchIdleHolders watches the acquisition of lease name on backend
// waiter (Config.IdleHolderAfter; package idleholder), counting, emitting
// and logging each session it ends.
func (c *Client) watchIdleHolders(ctx context.Context, name string, waiter *int64) (stop func()) {
	after := c.cfg.IdleHolderAfter
	look := func(stopping, ctx context.Context) ([]idleholder.Backend, error) {
		c.stats.idleLooks.Add(1)
		return c.idle.Look(stopping, ctx, c.cfg.Schema, name, after, waiter)
	}
	warned := false
	return idleholder.Watch(ctx, after, look, func(ended []idleholder.Backend, err error) {
		if err != nil {
			c.stats.idleLookErrors.Add(1)
		}
		for _, b := range backends(ended) {
			c.stats.idleEnded.Add(1)
			c.emit(Event{Kind: IdleHolderEnded, Lease: name, Backend: &b})
			c.log.Warn("pgfence: ended a session idle in a transaction on an expired lease's row, which blocked its acquisition",
				"lease", name, "pid", b.PID, "application", b.Application, "user", b.User,
				"xact_start", b.XactStart, "query", b.Query)
		}
		if err != nil && !warned && !errors.Is(err, idleholder.ErrClosed) {
			warned = true
			c.log.Warn("pgfence: an acquisition waits on an expired lease's row, and looking for sessions idle "+
				"in a transaction there, to end them, failed (see err; if it is a matter of rights: a role may end its own "+
				"role's sessions, and others' with pg_signal_backend, seeing their state with pg_read_all_stats; or bound "+
				"guarded transactions at the server: Config.GuardIdleTimeout)",
				"lease", name, "err", err)
		}
	})
}

// backends converts the sessions package idleholder reports.
func backends(bs []idleholder.Backend) []Backend {
	out := make([]Backend, len(bs))
	for i, b := range bs {
		out[i] = Backend(b)
	}
	return out
}

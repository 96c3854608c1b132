package runner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/lock"
)

// Health says whether the runner is doing its work, for a readiness probe
// (lock.HealthHandler serves it over HTTP): nil, or an error matching
// lock.ErrUnhealthy that says why. It is unhealthy when Run is not running
// (not started, still checking the schema, or returned), when its lock
// client is (lock.Client.Health: the database does not answer, renewals
// failing or late), and when the instance's heartbeats have not succeeded
// for a TTL: the other replicas then count it gone and take its jobs.
func (r *Runner) Health(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "runner: Health"); err != nil {
		return err
	}
	if !r.live.Load() {
		return fmt.Errorf("%w: the runner is not running (not started, starting, or stopped)", lock.ErrUnhealthy)
	}
	var why []error
	if err := r.lc.Health(ctx); err != nil {
		why = append(why, err)
	}
	// Since the last heartbeat, or since Run started the jobs (a runner
	// with nothing registered sends none).
	if at := r.lastBeat.Load(); at != nil && time.Since(*at) > r.lcfg.TTL {
		since := time.Since(*at)
		why = append(why, fmt.Errorf("%w: no heartbeat has succeeded for %v (TTL %v): the other replicas count this one gone",
			lock.ErrUnhealthy, since.Round(time.Millisecond), r.lcfg.TTL))
	}
	return errors.Join(why...)
}

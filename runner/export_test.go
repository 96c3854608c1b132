package runner

import "github.com/pgfence/pgfence/internal/clock"

// SetClock makes the runner compute and wait for its slots on c; call it
// before Run.
func (r *Runner) SetClock(c clock.Clock) { r.clock = c }

// Package linear records histories of fenced operations and checks them for
// linearizability with porcupine against a fenced-register model: the state
// is {token, value} for one lease; an acquisition must return a greater token
// than any before it; a write with token t succeeds exactly when t is the
// newest token issued (and is refused when a newer one exists); a read returns
// the last successful write. Operations whose outcome is unknown (a connection
// lost during COMMIT) may or may not have taken effect.
package linear

import (
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// Kind is an operation kind.
type Kind int

// Operation kinds.
const (
	Acquire Kind = iota
	Write
	Read
)

// Input is what an operation was asked to do.
type Input struct {
	Kind  Kind
	Token int64 // Write: the token presented
	Value int64 // Write: the value written (unique per write)
}

// Output is what an operation observed.
type Output struct {
	Token   int64 // Acquire: the token obtained (with Unknown: the token issued, if known; 0 if not)
	OK      bool  // Write: accepted (false: refused as stale)
	Unknown bool  // the outcome is not known
	Value   int64 // Read: the value read
}

// state is the register: the newest token known to be issued, the value, and
// whether an acquisition of unknown outcome may since have issued a newer
// token whose value nobody saw (tokens come from a sequence, so it cannot be
// guessed): then a write with token is refused, as a stale one would be.
type state struct {
	token, value int64
	newer        bool
}

// Model is the fenced-register model.
var Model = porcupine.NondeterministicModel{
	Init: func() []any { return []any{state{}} },
	Step: func(st, in, out any) []any {
		s, i, o := st.(state), in.(Input), out.(Output)
		current := func(tok int64) bool { return tok == s.token && !s.newer }
		switch i.Kind {
		case Acquire:
			if o.Unknown {
				// Token, if known (an acquisition that won but whose
				// lease was never handed out), is newer only while no
				// greater token has been seen.
				if o.Token != 0 && o.Token <= s.token {
					return []any{s}
				}
				return []any{s, state{s.token, s.value, true}}
			}
			if o.Token > s.token {
				return []any{state{o.Token, s.value, false}}
			}
		case Write:
			switch {
			case o.Unknown:
				if current(i.Token) {
					return []any{s, state{s.token, i.Value, false}}
				}
				return []any{s}
			case o.OK && current(i.Token):
				return []any{state{s.token, i.Value, false}}
			case !o.OK && i.Token <= s.token && !current(i.Token):
				return []any{s}
			}
		case Read:
			if o.Value == s.value {
				return []any{s}
			}
		}
		return nil
	},
	DescribeOperation: func(in, out any) string {
		i, o := in.(Input), out.(Output)
		switch i.Kind {
		case Acquire:
			return fmt.Sprintf("acquire -> %d (unknown=%v)", o.Token, o.Unknown)
		case Write:
			return fmt.Sprintf("write(t=%d, v=%d) -> ok=%v unknown=%v", i.Token, i.Value, o.OK, o.Unknown)
		}
		return fmt.Sprintf("read -> %d", o.Value)
	},
}

// Recorder collects a concurrent history. It is safe for concurrent use.
type Recorder struct {
	start time.Time
	mu    sync.Mutex
	ops   []porcupine.Operation
}

// NewRecorder starts a history.
func NewRecorder() *Recorder { return &Recorder{start: time.Now()} }

// Now returns the history's clock, for an operation's call time.
func (r *Recorder) Now() int64 { return int64(time.Since(r.start)) }

// Add records a completed operation called at call.
func (r *Recorder) Add(client int, call int64, in Input, out Output) {
	ret := r.Now()
	if out.Unknown {
		// It may take effect at any later time.
		ret = math.MaxInt64
	}
	r.mu.Lock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
	r.mu.Unlock()
}

// Len returns the number of operations recorded.
func (r *Recorder) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.ops)
}

// Check checks the history; it returns porcupine.Ok, Illegal or Unknown (on
// timeout).
func (r *Recorder) Check(timeout time.Duration) porcupine.CheckResult {
	r.mu.Lock()
	ops := append([]porcupine.Operation(nil), r.ops...)
	r.mu.Unlock()
	return porcupine.CheckOperationsTimeout(Model.ToModel(), ops, timeout)
}

// Explain checks the history and, if it is not linearizable, writes
// porcupine's HTML visualization of it to path (for diagnosis).
func (r *Recorder) Explain(timeout time.Duration, path string) (porcupine.CheckResult, error) {
	r.mu.Lock()
	ops := append([]porcupine.Operation(nil), r.ops...)
	r.mu.Unlock()
	m := Model.ToModel()
	res, info := porcupine.CheckOperationsVerbose(m, ops, timeout)
	if res == porcupine.Ok {
		return res, nil
	}
	return res, porcupine.VisualizePath(m, info, path)
}

// AddAt records an operation with explicit call and return times (for
// histories gathered from several processes, in Unix nanoseconds).
func (r *Recorder) AddAt(client int, call, ret int64, in Input, out Output) {
	r.mu.Lock()
	r.ops = append(r.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
	r.mu.Unlock()
}

package linear

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// The model must reject what fencing forbids and accept what it allows;
// otherwise the suites that rely on it would check nothing.
func TestModel(t *testing.T) {
	acq := func(c int, call, ret, tok int64) porcupine.Operation {
		return porcupine.Operation{ClientId: c, Input: Input{Kind: Acquire}, Output: Output{Token: tok}, Call: call, Return: ret}
	}
	wr := func(c int, call, ret, tok, v int64, ok, unknown bool) porcupine.Operation {
		return porcupine.Operation{ClientId: c, Input: Input{Kind: Write, Token: tok, Value: v}, Output: Output{OK: ok, Unknown: unknown}, Call: call, Return: ret}
	}
	rd := func(c int, call, ret, v int64) porcupine.Operation {
		return porcupine.Operation{ClientId: c, Input: Input{Kind: Read}, Output: Output{Value: v}, Call: call, Return: ret}
	}
	cases := []struct {
		name string
		ops  []porcupine.Operation
		want porcupine.CheckResult
	}{
		{"fenced handover", []porcupine.Operation{
			acq(0, 0, 1, 1), wr(0, 2, 3, 1, 10, true, false),
			acq(1, 4, 5, 2), wr(1, 6, 7, 2, 20, true, false),
			wr(0, 8, 9, 1, 11, false, false), rd(2, 10, 11, 20)}, porcupine.Ok},
		{"stale write accepted after the takeover returned", []porcupine.Operation{
			acq(0, 0, 1, 1), acq(1, 2, 3, 2), wr(0, 4, 5, 1, 10, true, false)}, porcupine.Illegal},
		{"stale write overwrites the new leader's value", []porcupine.Operation{
			acq(0, 0, 1, 1), acq(1, 2, 3, 2), wr(1, 4, 5, 2, 20, true, false),
			wr(0, 3, 8, 1, 10, true, false), rd(2, 9, 10, 10)}, porcupine.Illegal},
		{"current token refused", []porcupine.Operation{
			acq(0, 0, 1, 1), wr(0, 2, 3, 1, 10, false, false)}, porcupine.Illegal},
		{"token not greater", []porcupine.Operation{
			acq(0, 0, 1, 2), acq(1, 2, 3, 2)}, porcupine.Illegal},
		{"unknown write may have happened", []porcupine.Operation{
			acq(0, 0, 1, 1), wr(0, 2, 1<<40, 1, 10, false, true), rd(1, 5, 6, 10), rd(1, 7, 8, 10)}, porcupine.Ok},
		{"unknown acquisition may have happened", []porcupine.Operation{
			acq(0, 0, 1, 1), {ClientId: 1, Input: Input{Kind: Acquire}, Output: Output{Unknown: true}, Call: 2, Return: 1 << 40},
			wr(0, 5, 6, 1, 10, false, false)}, porcupine.Ok},
		{"unknown acquisition may not have happened", []porcupine.Operation{
			acq(0, 0, 1, 1), {ClientId: 1, Input: Input{Kind: Acquire}, Output: Output{Unknown: true}, Call: 2, Return: 1 << 40},
			wr(0, 5, 6, 1, 10, true, false), rd(2, 7, 8, 10)}, porcupine.Ok},
		// A token issued but never handed out (an Acquire that tried
		// again), at an unknown time: it explains a refusal while it is
		// the newest, not after a greater one.
		{"hidden token newer than the holder's explains a refusal", []porcupine.Operation{
			acq(0, 0, 1, 1), {ClientId: 1, Input: Input{Kind: Acquire}, Output: Output{Unknown: true, Token: 2}, Call: 0, Return: 1 << 40},
			wr(0, 5, 6, 1, 10, false, false), acq(2, 7, 8, 3)}, porcupine.Ok},
		{"hidden token older than the holder's explains nothing", []porcupine.Operation{
			acq(0, 0, 1, 2), {ClientId: 1, Input: Input{Kind: Acquire}, Output: Output{Unknown: true, Token: 1}, Call: 0, Return: 1 << 40},
			wr(0, 5, 6, 2, 10, false, false)}, porcupine.Illegal},
		{"token above every one issued refused as stale", []porcupine.Operation{
			acq(0, 0, 1, 1), wr(0, 2, 3, 5, 10, false, false)}, porcupine.Illegal},
		{"read of a value never written", []porcupine.Operation{rd(0, 0, 1, 99)}, porcupine.Illegal},
	}
	for _, tc := range cases {
		if got := porcupine.CheckOperationsTimeout(Model.ToModel(), tc.ops, 10*time.Second); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

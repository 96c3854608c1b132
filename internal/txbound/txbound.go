// Package txbound lets a lease bound a fenced transaction without becoming
// its caller's budget: Lease.RunTx and the runner's Partition.Commit pass
// the caller's context to fence's RunTx with the lease's context attached.
// The transaction's statements are cancelled, and COMMIT is not sent, once
// the lease ends; a COMMIT whose answer is lost is still asked about
// within the caller's context, which the lease's end does not shorten.
package txbound

import "context"

type key struct{}

// With returns ctx carrying bound.
func With(ctx, bound context.Context) context.Context {
	return context.WithValue(ctx, key{}, bound)
}

// From returns the bound ctx carries, if any.
func From(ctx context.Context) (context.Context, bool) {
	b, ok := ctx.Value(key{}).(context.Context)
	return b, ok
}

// Package chaos is pgfence's fault-injection suite. Its tests start a private
// PostgreSQL cluster, run worker processes (the test binary, re-executed) that
// campaign for a lease, write a fenced register through guarded transactions
// and a resource fence, and run a runner job that charges customers every
// "night"; meanwhile they pause workers past their TTL (SIGSTOP/SIGCONT),
// kill their connections, break their network through a TCP proxy, move lease
// expiries under their holders, and crash and restart PostgreSQL. Then it
// checks the history for linearizability against a fenced-register model, the
// ledger for double and lost charges, and the tokens for regressions, and
// runs a negative control with the fence switched off that must be caught.
//
//	go test -run TestFaultSuite -v ./internal/chaos                  # bounded (about 90 s)
//	CHAOS_SEED=1234 go test -run TestFaultSuite -v ./internal/chaos  # replay a seed's fault schedule
//	CHAOS_DURATION=10m go test -run TestFaultSuite -timeout 30m -v ./internal/chaos  # soak
package chaos

// Package web serves pgfence's status page: an http.Handler an application
// mounts in its own mux, and that `pgfence ui` serves from the CLI.
//
// The page answers at a glance who leads what and whether anything is stuck:
//   - Leases: every lease with its holder, token (and the database history,
//     the epoch, it was issued in), how long it has been held and a
//     countdown to its expiry; leases expired but not released, and leases
//     whose renewal is overdue, are marked.
//   - Jobs: each runner job with its pause state, leader, last and next
//     slot, and the recent attempts from the ledger, failed and fenced ones
//     marked, with their error text.
//   - Fleet: the live runner instances, the job shards each leads, and the
//     recent leadership terms.
//
// Open pages update in place (they poll; no reload), and say so when they
// cannot: each request's database work is bounded by 15 s (a database that
// stops answering fails it, instead of holding it until TCP gives up),
// and a page gives up a refresh the network holds. Everything served is
// embedded: no CDN, fonts or external scripts, and every response carries a
// strict Content-Security-Policy. The pages read without JavaScript (they
// then update on reload only) and with the keyboard.
//
// # Actions
//
// With Config.AllowActions, the pages also offer force release (after a
// confirmation page, as the CLI asks), run now, pause and resume. They are
// POST only, refused for cross-origin browser requests
// (http.CrossOriginProtection), and each is logged with the request's remote
// address and the identity Config.Identity returns. Without AllowActions the
// buttons are absent and every POST is answered 403.
//
// # Names
//
// The handler answers only to the names it is served under: localhost, IP
// addresses, and Config.Hosts. Any other Host is refused with 421, so that a
// web page whose name resolves to 127.0.0.1 (DNS rebinding) cannot read or
// steer a page served on a developer's machine.
//
// # Roles
//
// The pages and the JSON endpoints only read: a role given
// migrations.GrantOperator is enough, and so are the actions.
//
// # JSON
//
// The same data, in the shapes the CLI's --json prints:
//   - GET api/leases: [lock.Info] (`pgfence leases --json`)
//   - GET api/jobs[?job=NAME]: [runner.JobInfo] (`pgfence jobs status --json`)
//   - GET api/runs[?job=NAME][&status=S][&limit=N]: [runner.RunInfo] (`pgfence jobs --json`)
//   - GET api/fleet: {"instances": [runner.InstanceInfo], "partitions": [runner.PartitionInfo], "terms": [runner.Term]}
//   - GET api/groups[?group=NAME]: [runner.PartitionInfo] (`pgfence groups --json`)
//   - GET api/terms[?job=NAME|group=NAME]: [runner.Term], newest first
//   - GET api/epoch: migrations.Epoch, the database history tokens are issued in
//
// GET healthz answers 200 "ok" while the database answers a ping within
// 2 s, else 503 with the error (plain text), for the platform's probes.
//
// Paths are relative to where the handler is mounted.
package web

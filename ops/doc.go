// Package ops ships what an operator of pgfence needs beside the library:
// Prometheus alerting rules (pgfence-alerts.yml), with their unit tests
// (alerts-test.yml, for promtool), and a Grafana dashboard
// (grafana-dashboard.json). Its tests run the rules through promtool and
// every alert's expression against what a running pgfence really emits,
// scraped by a real Prometheus (Debian: apt-get install prometheus). It is
// a module of its own, so that the Prometheus exporter it tests with never
// reaches the go.sum of pgfence's importers.
//
//	cd ops && go test ./...
package ops

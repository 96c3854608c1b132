// Package buckets holds the explicit bucket boundaries of pgfence's
// histograms, in seconds. Without them the OpenTelemetry SDK's defaults
// (0, 5, 10 ... 10000, made for milliseconds) apply, and every value in
// seconds lands in one bucket: a quantile then answers nothing.
package buckets

// Latency is for round trips to the database (a renewal, a fence check):
// from 0.1 ms to 10 s, each boundary at most twice the one before, so that
// a quantile read off the buckets (Prometheus' histogram_quantile
// interpolates within one) is within 2x of the true value.
var Latency = []float64{
	0.0001, 0.0002, 0.0003, 0.0005, 0.00075,
	0.001, 0.002, 0.003, 0.005, 0.0075,
	0.01, 0.02, 0.03, 0.05, 0.075,
	0.1, 0.2, 0.3, 0.5, 0.75,
	1, 2, 3, 5, 7.5, 10,
}

// TrustLeft is for what is left of a lease's trust window at a renewal:
// around the TTL (15 s by default) and RenewInterval (a third of it), from
// 50 ms to 2 minutes.
var TrustLeft = []float64{0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 4, 5, 7.5, 10, 12.5, 15, 20, 30, 60, 120}

// Wait is for how long a blocking acquisition waited, and how long a job's
// attempt ran: from 10 ms to an hour.
var Wait = []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600}

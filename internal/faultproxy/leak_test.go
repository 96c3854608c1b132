package faultproxy

import (
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestMain finds the test database (TEST_DATABASE_URL) for the tests that
// commit through the proxy, and fails the package's tests if any of them
// leaves a goroutine running.
func TestMain(m *testing.M) { pgtest.Main(m) }

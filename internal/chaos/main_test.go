package chaos

import (
	"os"
	"testing"

	"github.com/pgfence/pgfence/internal/pgtest"
)

// roleEnv makes the re-executed test binary a worker instead of running tests.
const roleEnv = "CHAOS_ROLE"

func TestMain(m *testing.M) {
	switch os.Getenv(roleEnv) {
	case "worker":
		os.Exit(workerMain())
	case "partition":
		os.Exit(partitionWorkerMain())
	}
	pgtest.Main(m) // the test database (TestWireFaults), and goleak
}

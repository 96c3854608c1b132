package chaos

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// roleEnv makes the re-executed test binary a worker instead of running tests.
const roleEnv = "CHAOS_ROLE"

func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) == "worker" {
		os.Exit(workerMain())
	}
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

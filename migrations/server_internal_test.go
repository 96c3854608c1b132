package migrations

import (
	"errors"
	"testing"
)

// Up refuses servers older than PostgreSQL 13 (server_version_num), naming
// both versions; 13 and newer pass.
func TestCheckServerRefusesOldVersions(t *testing.T) {
	for _, tc := range []struct {
		num int
		ok  bool
	}{{90624, false}, {120017, false}, {130000, true}, {150020, true}, {170002, true}} {
		err := checkServer(tc.num)
		if (err == nil) != tc.ok || !tc.ok && !errors.Is(err, ErrUnsupportedServer) {
			t.Errorf("checkServer(%d) = %v; want ok=%v", tc.num, err, tc.ok)
		}
	}
}

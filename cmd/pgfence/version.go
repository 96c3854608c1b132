package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// version describes the binary from its build information: the module
// version (a release tag when installed with `go install ...@vX.Y.Z`,
// "(devel)" when built from a checkout) and, when built from a git checkout,
// the commit, its time and whether the tree had uncommitted changes.
func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "pgfence (no build information) " + runtime.Version()
	}
	v := bi.Main.Version
	if v == "" {
		v = "(devel)"
	}
	s := fmt.Sprintf("pgfence %s %s", v, bi.GoVersion)
	var rev, at, dirty string
	for _, kv := range bi.Settings {
		switch kv.Key {
		case "vcs.revision":
			rev = kv.Value
		case "vcs.time":
			at = kv.Value
		case "vcs.modified":
			if kv.Value == "true" {
				dirty = " (modified)"
			}
		}
	}
	if rev != "" {
		s += "\ncommit " + rev + dirty
		if at != "" {
			s += " " + at
		}
	}
	return s
}

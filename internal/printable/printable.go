// Package printable shows text read from the database (lease names,
// holders, job names, error messages) to operators, in a terminal or a web
// page, without letting it forge lines, escape sequences or bidirectional
// overrides.
package printable

import "strconv"

// String returns s when every rune of it is printable (strconv.IsPrint),
// and otherwise s quoted with Go's escapes, so that control characters,
// invalid UTF-8 and format characters (U+202E and the like) show as \x1b,
// \u202e... instead of acting.
func String(s string) string {
	q := strconv.Quote(s)
	if q[1:len(q)-1] == s {
		return s
	}
	return q
}

// Package printable shows text read from the database (lease names,
// holders, job names, error messages) to operators, in a terminal or a web
// page, without letting it forge lines, escape sequences or bidirectional
// overrides.
package printable

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

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

// Text returns s for showing as text in a block that keeps its lines (an
// error message on a page): line feeds and tabs stay, every other rune
// that is not printable (control characters, U+202E and the like, invalid
// UTF-8) is written as its escape (\x1b, \u202e, \xff), and nothing is
// quoted, so that quotation marks in a message read as they were written.
func Text(s string) string {
	var b strings.Builder
	for i, r := range s {
		switch {
		case r == utf8.RuneError && !strings.HasPrefix(s[i:], "\uFFFD"):
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\n' || r == '\t' || strconv.IsPrint(r):
			b.WriteRune(r)
		default:
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		}
	}
	return b.String()
}

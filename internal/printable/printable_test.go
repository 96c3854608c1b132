package printable

import "testing"

func TestString(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"nightly-billing", "nightly-billing"},
		{"<b>bold</b> & 'quoted'", "<b>bold</b> & 'quoted'"},
		{"line\nforged", `"line\nforged"`},
		{"\x1b[31mred", `"\x1b[31mred"`},
		{"abc\u202edcba", `"abc\u202edcba"`},
		{"bad\xffutf8", `"bad\xffutf8"`},
		{`say "hi"`, `"say \"hi\""`}, // quoted, so that a quoted form cannot pass for plain text
		{"", ""},
	} {
		if got := String(c.in); got != c.want {
			t.Errorf("String(%q) = %s, want %s", c.in, got, c.want)
		}
	}
}

func TestText(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{`lease changed: held by "n2"`, `lease changed: held by "n2"`}, // quotes as written
		{"two\nlines\tand a tab", "two\nlines\tand a tab"},
		{"\x1b[31mred \u202eevil", `\x1b[31mred \u202eevil`},
		{"bad\xffutf8 \uFFFD", "bad\\xffutf8 \uFFFD"}, // a real U+FFFD is printable
		{"\r\x00", `\r\x00`},
	} {
		if got := Text(c.in); got != c.want {
			t.Errorf("Text(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

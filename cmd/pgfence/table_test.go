package main

import (
	"os"
	"strings"
	"testing"
)

// The package documentation lists exactly the command table's usage lines,
// and every command is found by its own name.
func TestDocListsTheCommandTable(t *testing.T) {
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	var doc []string
	in := false
	for _, l := range strings.Split(string(src), "\n") {
		switch {
		case l == "// Commands:":
			in = true
		case in && strings.HasPrefix(l, "//\t"):
			doc = append(doc, strings.TrimPrefix(l, "//\t"))
		case in && l != "//":
			in = false
		}
	}
	var want []string
	for _, l := range strings.Split(usageText(), "\n") {
		if rest, ok := strings.CutPrefix(l, "  "); ok {
			want = append(want, rest)
		}
	}
	if strings.Join(doc, "\n") != strings.Join(want, "\n") {
		t.Fatalf("main.go's Commands section:\n%s\n\nthe table's usage:\n%s", strings.Join(doc, "\n"), strings.Join(want, "\n"))
	}
	for _, c := range commands {
		got, _, ok := lookup(strings.Fields(c.name))
		if !ok || got.name != c.name {
			t.Errorf("lookup(%q) = %q, %v", c.name, got.name, ok)
		}
	}
	if _, _, ok := lookup([]string{"nope"}); ok {
		t.Error(`lookup("nope") found a command`)
	}
}

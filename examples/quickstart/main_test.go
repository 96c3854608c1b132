package main

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// The quick start runs and charges three customers under one token.
func TestQuickStart(t *testing.T) {
	db := pgtest.New(t)
	pool := pgtest.NewPool(t, "quickstart", func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{db.Schema}.Sanitize() // its charges table
	})
	var out strings.Builder
	if err := run(pgtest.Context(t, time.Minute), pool, db.Schema, &out); err != nil {
		t.Fatal(err)
	}
	if strings.Count(out.String(), "charged") != 3 {
		t.Fatalf("output:\n%s", out.String())
	}
}

// Issue 14.1: every Go block in README.md is code that compiles: it stands,
// line for line (indentation aside), in a Go file of this repository that
// the build or the tests compile. So README's code cannot rot.
func TestREADMEGoBlocksAreCompiledCode(t *testing.T) {
	root := filepath.Join("..", "..")
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	var blocks [][]string
	var cur []string
	in := false
	sc := bufio.NewScanner(strings.NewReader(string(readme)))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case !in && strings.TrimSpace(line) == "```go":
			in, cur = true, nil
		case in && strings.TrimSpace(line) == "```":
			in = false
			blocks = append(blocks, cur)
		case in:
			cur = append(cur, line)
		}
	}
	if len(blocks) == 0 {
		t.Fatal("README.md has no Go block")
	}
	var files [][]string
	err = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") || !strings.HasSuffix(p, ".go") {
			return err
		}
		b, err := os.ReadFile(p)
		files = append(files, strings.Split(string(b), "\n"))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	norm := func(lines []string) []string {
		var out []string
		for _, l := range lines {
			if l = strings.TrimSpace(l); l != "" {
				out = append(out, l)
			}
		}
		return out
	}
	contains := func(file, block []string) bool {
		f, b := norm(file), norm(block)
		for i := 0; i+len(b) <= len(f); i++ {
			match := true
			for j := range b {
				if f[i+j] != b[j] {
					match = false
					break
				}
			}
			if match {
				return true
			}
		}
		return false
	}
	for i, b := range blocks {
		found := false
		for _, f := range files {
			if contains(f, b) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("README Go block %d is not code of this repository (copy it from, or into, a compiled file):\n%s", i+1, strings.Join(b, "\n"))
		}
	}
}

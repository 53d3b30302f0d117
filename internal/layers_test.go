// Package internal_test holds the rule that keeps internal/ at the bottom
// of the import graph (DESIGN.md, "Layout").
package internal_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// Plumbing under internal/ is no one's domain: it imports no package of
// the product above it, and neither do its tests, so the import graph
// runs one way. A package that needs the product (the fault run, a
// migrated test database) lives beside what it drives, not in here.
func TestInternalImportsNothingAbove(t *testing.T) {
	const module = "github.com/fanout/fanout/"
	out, err := exec.Command("go", "list", "./...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list ./...: %v\n%s", err, out)
	}
	pkgs := strings.Fields(string(out))
	if len(pkgs) < 10 {
		t.Fatalf("go list ./... under internal/ found %d packages (%v): the test looks at the wrong tree", len(pkgs), pkgs)
	}
	for _, pkg := range pkgs {
		if problems := importsAbove(t, pkg, module); len(problems) > 0 {
			t.Errorf("%s (or its tests) imports %s: plumbing imports nothing of the product", strings.TrimPrefix(pkg, module), strings.Join(problems, ", "))
		}
	}
}

// importsAbove lists the module's packages outside internal/ that pkg or
// its tests import, directly or not.
func importsAbove(t *testing.T, pkg, module string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-test", pkg).CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps -test %s: %v\n%s", pkg, err, out)
	}
	var above []string
	for _, line := range strings.Split(string(out), "\n") {
		// go list -test also names a package's test variants:
		// "x [x.test]", "x_test [x.test]" and "x.test".
		dep, _, _ := strings.Cut(line, " ")
		dep = strings.TrimSuffix(strings.TrimSuffix(dep, ".test"), "_test")
		rel, ok := strings.CutPrefix(dep, module)
		if !ok || rel == "internal" || strings.HasPrefix(rel, "internal/") {
			continue
		}
		above = append(above, rel)
	}
	return above
}

// The map in docs/design.md says what each package may import; the code
// must agree. Every package needs a row, and every import of the
// module's own packages (but of its own subpackages and of internal/)
// must be one its row allows.
func TestImportsFollowTheMap(t *testing.T) {
	const module = "github.com/fanout/fanout/"
	rows := readMap(t, "../docs/design.md")
	out, err := exec.Command("go", "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, module+"...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	checked := 0
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		pkg, ok := strings.CutPrefix(fields[0], module)
		if !ok || pkg == "internal" || strings.HasPrefix(pkg, "internal/") {
			continue
		}
		allowed, found := rows.allowed(pkg)
		if !found {
			t.Errorf("%s has no row in docs/design.md's map", pkg)
			continue
		}
		checked++
		for _, imp := range fields[1:] {
			dep, ok := strings.CutPrefix(imp, module)
			if !ok || strings.HasPrefix(dep, "internal/") || strings.HasPrefix(dep, pkg+"/") {
				continue
			}
			if !allowed(dep) {
				t.Errorf("%s imports %s, which its row in docs/design.md's map does not allow", pkg, dep)
			}
		}
	}
	if checked < 20 {
		t.Fatalf("checked %d packages against the map: the map or the module was not read", checked)
	}
}

// mapRows is the map's table: each row's packages and what they may import.
type mapRows []struct{ packages, imports []string }

// readMap reads the table under "## The map" in the design page.
func readMap(t *testing.T, path string) mapRows {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n## The map\n")
	if !ok {
		t.Fatalf("%s has no section \"The map\"", path)
	}
	section, _, _ = strings.Cut(section, "\n## ")
	var rows mapRows
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) != 5 || !strings.Contains(cells[1], "`") {
			continue // not a row of the table
		}
		rows = append(rows, struct{ packages, imports []string }{codeSpans(cells[1]), codeSpans(cells[3])})
		if strings.TrimSpace(cells[3]) == "any" {
			rows[len(rows)-1].imports = []string{"..."}
		}
	}
	if len(rows) < 10 {
		t.Fatalf("%s's map has %d rows", path, len(rows))
	}
	return rows
}

// codeSpans are the `...` spans of a cell.
func codeSpans(cell string) []string {
	var spans []string
	parts := strings.Split(cell, "`")
	for i := 1; i < len(parts); i += 2 {
		spans = append(spans, parts[i])
	}
	return spans
}

// allowed finds pkg's row (an exact name, "<parent>/<name>" for any
// subpackage of parent that has no row of its own, or "<parent>/..." for
// every package below parent) and says what it may import.
func (rows mapRows) allowed(pkg string) (func(string) bool, bool) {
	matches := func(pattern, pkg string, exactOnly bool) bool {
		switch {
		case pattern == pkg:
			return true
		case exactOnly:
			return false
		case strings.HasSuffix(pattern, "/..."):
			return strings.HasPrefix(pkg, strings.TrimSuffix(pattern, "...")) || pkg == strings.TrimSuffix(pattern, "/...")
		case strings.HasSuffix(pattern, "/<name>"):
			parent := strings.TrimSuffix(pattern, "<name>")
			rest, ok := strings.CutPrefix(pkg, parent)
			return ok && rest != "" && !strings.Contains(rest, "/")
		}
		return false
	}
	// An exact row first, then a pattern's.
	for _, exactOnly := range []bool{true, false} {
		for _, r := range rows {
			for _, p := range r.packages {
				if !matches(p, pkg, exactOnly) {
					continue
				}
				imports := r.imports
				return func(dep string) bool {
					for _, a := range imports {
						if a == "..." || a == dep {
							return true
						}
						// "<parent>/<name>" allows a subscriber's package:
						// one that has no exact row of its own.
						if strings.HasSuffix(a, "/<name>") && matches(a, dep, false) && !rows.hasExactRow(dep) {
							return true
						}
					}
					return false
				}, true
			}
		}
	}
	return nil, false
}

func (rows mapRows) hasExactRow(pkg string) bool {
	for _, r := range rows {
		for _, p := range r.packages {
			if p == pkg {
				return true
			}
		}
	}
	return false
}

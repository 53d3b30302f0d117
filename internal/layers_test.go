// Package internal_test holds the rule that keeps internal/ at the bottom
// of the import graph (DESIGN.md, "Layout").
package internal_test

import (
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

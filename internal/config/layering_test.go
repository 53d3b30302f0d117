package config_test

import (
	"os/exec"
	"strings"
	"testing"
)

// The plumbing under internal/ knows nothing of the domain: the packages
// that own settings import package config, never the reverse, so that
// the import graph runs one way. Only connect may import the search client
// it dials with. Their tests are held to it too.
func TestPlumbingImportsNoDomain(t *testing.T) {
	const module = "github.com/fanout/fanout/"
	domain := []string{"relay", "subscribers", "outbox", "stream", "shop", "operator", "search"}
	allowed := map[string][]string{"internal/connect": {"search"}}
	for _, pkg := range []string{"internal/config", "internal/connect", "internal/logging", "internal/tracing",
		"internal/metrics", "internal/opsserver", "internal/validate", "internal/jsretry"} {
		out, err := exec.Command("go", "list", "-deps", "-test", module+pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			rel, ok := strings.CutPrefix(dep, module)
			if !ok {
				continue
			}
			for _, d := range domain {
				if rel != d && !strings.HasPrefix(rel, d+"/") {
					continue
				}
				ok := false
				for _, a := range allowed[pkg] {
					ok = ok || rel == a
				}
				if !ok {
					t.Errorf("%s (or its tests) imports %s", pkg, rel)
				}
			}
		}
	}
}

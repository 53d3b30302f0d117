package deploy_test

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/moby/patternmatcher"
	"github.com/moby/patternmatcher/ignorefile"
)

// The build context is the repository root: .dockerignore there is the
// one that applies, read here with the reader and matcher that the docker
// CLI and BuildKit use (moby/patternmatcher and its ignorefile).

// dockerignore returns the root .dockerignore's matcher.
func dockerignore(t *testing.T) *patternmatcher.PatternMatcher {
	t.Helper()
	f, err := os.Open("../.dockerignore")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	patterns, err := ignorefile.ReadAll(f)
	if err != nil {
		t.Fatalf(".dockerignore: %v", err)
	}
	pm, err := patternmatcher.New(patterns)
	if err != nil {
		t.Fatalf(".dockerignore: %v", err)
	}
	return pm
}

// excluded reports whether path (relative to the repository root) stays
// out of the build context: it or a directory above it matches.
func excluded(t *testing.T, pm *patternmatcher.PatternMatcher, path string) bool {
	t.Helper()
	m, err := pm.MatchesOrParentMatches(filepath.ToSlash(filepath.Clean(path)))
	if err != nil {
		t.Fatalf(".dockerignore on %s: %v", path, err)
	}
	return m
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// Every image compose builds has the repository root as its context and
// deploy/Dockerfile as its Dockerfile, and no Dockerfile-specific ignore
// file (BuildKit would read deploy/Dockerfile.dockerignore instead of the
// root's): so the .dockerignore checked here is the one that applies.
func TestDockerignoreIsTheContexts(t *testing.T) {
	root := repoRoot(t)
	builds := 0
	for name, s := range loadCompose(t).Services {
		if s.Build == nil {
			continue
		}
		builds++
		if ctx, _ := filepath.Abs(s.Build.Context); ctx != root || s.Build.Dockerfile != "deploy/Dockerfile" {
			t.Errorf("service %s builds %s from context %s; want deploy/Dockerfile from the repository root %s", name, s.Build.Dockerfile, ctx, root)
		}
	}
	if builds == 0 {
		t.Fatal("compose.yaml builds no image: this test checks nothing")
	}
	for _, p := range []string{"Dockerfile.dockerignore", "../.dockerignore"} {
		_, err := os.Stat(p)
		if want := p == "../.dockerignore"; (err == nil) != want {
			t.Errorf("%s: exists %v, want %v", p, err == nil, want)
		}
	}
}

// Secrets, local state and build output stay out of the build context:
// compose's secret files (whether generated yet or not) and all of
// deploy/secrets, what the repository's .gitignore files ignore here (the
// local services' data and binaries, built binaries), and credentials or
// output files wherever they would be left.
func TestDockerignoreKeepsSecretsOut(t *testing.T) {
	pm := dockerignore(t)
	root := repoRoot(t)
	var out []string

	secrets := loadCompose(t).Secrets
	if len(secrets) == 0 {
		t.Fatal("compose.yaml has no secrets: this test checks less than it claims")
	}
	for name, s := range secrets {
		rel, err := filepath.Rel(root, s.File)
		if err != nil || strings.HasPrefix(rel, "..") {
			t.Errorf("secret %s is the file %s, outside the repository", name, s.File)
			continue
		}
		out = append(out, rel)
	}
	entries, err := os.ReadDir("secrets")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		out = append(out, filepath.Join("deploy/secrets", e.Name()))
	}

	// What .gitignore files say is local (not a global excludes file: what
	// a developer ignores for themselves is theirs to keep out).
	git := exec.Command("git", "ls-files", "--others", "--ignored", "--directory", "--exclude-per-directory=.gitignore")
	git.Dir = root
	ignored, err := git.Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	for _, p := range strings.Fields(string(ignored)) {
		out = append(out, strings.TrimSuffix(p, "/"))
	}

	out = append(out,
		".git/config", ".data/postgres/PG_VERSION", ".data/chaos.log", ".bin/nats-server", "fanout",
		"deploy/secrets/generate.sh", "deploy/secrets/nats_new_password",
		"relay/relay.test", "cpu.prof", "bench/relay/cpu.pprof", "cover.out", "internal/config/c.coverprofile",
		"deploy/opensearch/target/classes/fanout/opensearch/Launcher.class",
		".env", "deploy/.env.production", "deploy/nats/admin.creds", "deploy/nats/user.nk",
		"deploy/tls/server.key", "deploy/tls/client.pem", "certs/client.p12", "deploy/es_password",
	)
	for _, p := range out {
		if !excluded(t, pm, p) {
			t.Errorf("%s is in the build context; .dockerignore must keep it out", p)
		}
	}
	for _, p := range []string{"deploy/secrets", ".data", ".bin"} {
		if !slices.Contains(out, p) && !excluded(t, pm, p) {
			t.Errorf("%s is in the build context", p)
		}
	}
}

// Everything the Dockerfile's build reads is sent: the files it COPYs by
// name, and, for its `COPY . .`, every file `go build` compiles or embeds
// for the package it builds (listed by `go list` for the image's
// platform, CGO off as there), with go.mod and go.sum.
func TestDockerignoreSendsTheBuild(t *testing.T) {
	pm := dockerignore(t)
	root := repoRoot(t)
	copies, pkg := readDockerfile(t)
	if pkg == "" {
		t.Fatal("deploy/Dockerfile runs no `go build`: this test checks nothing")
	}
	var need []string
	for _, src := range copies {
		if src != "." {
			need = append(need, src)
		}
	}
	if !slices.Contains(copies, ".") {
		t.Fatalf("deploy/Dockerfile copies %v, not the context: update this test to what the build reads", copies)
	}
	need = append(need, "go.mod", "go.sum")
	// `go mod download`, before `COPY . .`, reads the go.mod of every
	// module go.mod replaces with a directory: each is copied by name.
	for _, dir := range localReplacements(t, root) {
		if !slices.ContainsFunc(copies, func(src string) bool { return filepath.Clean(src) == dir }) {
			t.Errorf("go.mod replaces a module with %s, and deploy/Dockerfile does not copy it before `go mod download`", dir)
		}
	}

	list := exec.Command("go", "list", "-deps", "-json=Dir,Module,GoFiles,CgoFiles,SFiles,HFiles,CFiles,SysoFiles,EmbedFiles", pkg)
	list.Dir = root
	list.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux")
	stdout, err := list.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list %s: %v\n%s", pkg, err, ee.Stderr)
		}
		t.Fatal(err)
	}
	dec := json.NewDecoder(strings.NewReader(string(stdout)))
	embedded := 0
	for {
		var p struct {
			Dir    string
			Module *struct{ Main bool }
			GoFiles, CgoFiles, SFiles, HFiles, CFiles, SysoFiles,
			EmbedFiles []string
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if p.Module == nil || !p.Module.Main {
			continue // the standard library and modules, fetched by `go mod download`
		}
		dir, err := filepath.Rel(root, p.Dir)
		if err != nil {
			t.Fatal(err)
		}
		embedded += len(p.EmbedFiles)
		for _, files := range [][]string{p.GoFiles, p.CgoFiles, p.SFiles, p.HFiles, p.CFiles, p.SysoFiles, p.EmbedFiles} {
			for _, f := range files {
				need = append(need, filepath.Join(dir, f))
			}
		}
	}
	if len(need) < 30 || embedded == 0 {
		t.Fatalf("the build reads %d files, %d of them embedded: fewer than it does, the listing is broken", len(need), embedded)
	}
	for _, p := range need {
		if excluded(t, pm, p) {
			t.Errorf("%s is needed by the image's build, and .dockerignore leaves it out", p)
		}
	}
}

// localReplacements returns the directories go.mod replaces modules with.
func localReplacements(t *testing.T, root string) []string {
	t.Helper()
	edit := exec.Command("go", "mod", "edit", "-json")
	edit.Dir = root
	out, err := edit.Output()
	if err != nil {
		t.Fatalf("go mod edit -json: %v", err)
	}
	var mod struct {
		Replace []struct {
			New struct{ Path, Version string }
		}
	}
	if err := json.Unmarshal(out, &mod); err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, r := range mod.Replace {
		if r.New.Version == "" && (strings.HasPrefix(r.New.Path, "./") || strings.HasPrefix(r.New.Path, "../")) {
			dirs = append(dirs, filepath.Clean(r.New.Path))
		}
	}
	return dirs
}

// readDockerfile returns the sources of deploy/Dockerfile's COPY
// instructions from the build context (not --from another stage), and the
// package its `go build` builds.
func readDockerfile(t *testing.T) (copies []string, pkg string) {
	t.Helper()
	f, err := os.Open("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		switch strings.ToUpper(fields[0]) {
		case "COPY", "ADD":
			args := fields[1:]
			for len(args) > 0 && strings.HasPrefix(args[0], "--") {
				if strings.HasPrefix(args[0], "--from") {
					args = nil
					break
				}
				args = args[1:]
			}
			if len(args) >= 2 {
				copies = append(copies, args[:len(args)-1]...)
			}
		case "RUN":
			if i := slices.Index(fields, "build"); i > 0 && fields[i-1] == "go" {
				pkg = fields[len(fields)-1]
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return copies, pkg
}

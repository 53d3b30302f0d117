package deploy_test

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The secret files generate.sh writes are readable by the image's user
// (the distroless nonroot user, not their owner: Compose mounts file
// secrets as they are), every secret compose.yaml mounts is one it writes,
// and the directory keeps other users of the host out.
func TestSecretFilesReadableByTheImagesUserOnly(t *testing.T) {
	user := imageUser(t)
	if user == "" || user == "root" || user == "0" || strings.HasPrefix(user, "0:") || strings.HasPrefix(user, "root:") {
		t.Fatalf("the image runs as %q; want a non-root user", user)
	}
	dir := t.TempDir()
	generate(t, dir)
	st, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o700 {
		t.Errorf("the secrets directory is %v; want 0700 (its owner only)", st.Mode().Perm())
	}
	p := loadCompose(t)
	if len(p.Secrets) == 0 {
		t.Fatal("compose.yaml mounts no secrets")
	}
	for name, sec := range p.Secrets {
		f := filepath.Join(dir, filepath.Base(sec.File))
		st, err := os.Stat(f)
		if err != nil {
			t.Errorf("secret %s: generate.sh did not write %s", name, filepath.Base(sec.File))
			continue
		}
		// The container's user is not the file's owner (nor in its
		// group): only the "other" read bit lets it read the file.
		if st.Mode().Perm()&0o004 == 0 {
			t.Errorf("secret %s is %v: the image's user %s cannot read it", name, st.Mode().Perm(), user)
		}
		if st.Mode().Perm()&0o022 != 0 {
			t.Errorf("secret %s is %v: writable by others", name, st.Mode().Perm())
		}
	}
}

// generate runs secrets/generate.sh in dir, as an operator runs it in
// deploy/secrets: it writes what is missing there.
func generate(t *testing.T, dir string) {
	t.Helper()
	script, err := os.ReadFile(filepath.Join("secrets", "generate.sh"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "generate.sh"), script, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("bash", filepath.Join(dir, "generate.sh")).CombinedOutput(); err != nil {
		t.Fatalf("generate.sh: %v\n%s", err, out)
	}
}

// imageUser is the USER of the Dockerfile's final stage.
func imageUser(t *testing.T) string {
	t.Helper()
	f, err := os.Open("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	user := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		switch {
		case len(fields) >= 2 && strings.EqualFold(fields[0], "FROM"):
			user = "" // a new stage
			if strings.HasSuffix(fields[1], ":nonroot") {
				user = "nonroot"
			}
		case len(fields) >= 2 && strings.EqualFold(fields[0], "USER"):
			user = fields[1]
		}
	}
	return user
}

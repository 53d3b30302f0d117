// Package repo locates the repository's own files (the pinned binaries in
// .bin/, the deploy scripts) from tests and tools run anywhere inside it.
package repo

import (
	"errors"
	"os"
	"path/filepath"
)

// Root returns the directory holding go.mod, searching upwards from the
// working directory.
func Root() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// Bin returns the path of a pinned binary that deploy/services.sh installs
// into .bin/.
func Bin(name string) (string, error) {
	root, err := Root()
	if err != nil {
		return "", err
	}
	p := filepath.Join(root, ".bin", name)
	if _, err := os.Stat(p); err != nil {
		return "", errors.New(p + " is missing: run deploy/services.sh up (or go tool task up) first")
	}
	return p, nil
}

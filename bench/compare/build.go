package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// tree is a checkout the benchmark programs of one side are built in and
// run from: some read files relative to their working directory
// (deploy/nats/nats-server.conf), and bench:search builds that tree's
// `fanout`.
type tree struct {
	dir   string
	label string // what the table calls the side: "a7e18de (2026-12-06 20:49)"
	tags  string // build tags, comma-separated
}

// git runs git in dir and returns its trimmed output.
func git(ctx context.Context, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(exit.Stderr)))
		}
		return "", fmt.Errorf("git %s: %w", strings.Join(args, " "), err)
	}
	return strings.TrimSpace(string(out)), nil
}

// workingTree is the checkout this program runs in, uncommitted changes
// included.
func workingTree(ctx context.Context) (tree, error) {
	top, err := git(ctx, ".", "rev-parse", "--show-toplevel")
	if err != nil {
		return tree{}, fmt.Errorf("find the working tree: %w", err)
	}
	head, err := git(ctx, top, "log", "-1", "--format=%h")
	if err != nil {
		return tree{}, err
	}
	label := "working tree at " + head
	if dirty, err := git(ctx, top, "status", "--porcelain", "--untracked-files=no"); err == nil && dirty != "" {
		label += " + uncommitted changes"
	}
	return tree{dir: top, label: label}, nil
}

// worktree is a detached `git worktree` of the old side's commit.
type worktree struct {
	repo, parent string
	tree
}

// addWorktree checks ref out in a new temporary directory. Call remove on
// every path out, also after an error or an interrupt.
func addWorktree(ctx context.Context, repo, ref string) (*worktree, error) {
	commit, err := git(ctx, repo, "rev-parse", "--verify", "--quiet", ref+"^{commit}")
	if err != nil {
		return nil, fmt.Errorf("REF %q is not a commit of %s", ref, repo)
	}
	label, err := git(ctx, repo, "log", "-1", "--date=format:%Y-%m-%d %H:%M", "--format=%h (%cd)", commit)
	if err != nil {
		return nil, err
	}
	parent, err := os.MkdirTemp("", "fanout-bench-compare-ref-")
	if err != nil {
		return nil, err
	}
	w := &worktree{repo: repo, parent: parent, tree: tree{dir: filepath.Join(parent, "tree"), label: label}}
	if _, err := git(ctx, repo, "worktree", "add", "--detach", w.dir, commit); err != nil {
		w.remove()
		return nil, err
	}
	// .bin holds the servers deploy/services.sh installed, the host's and
	// not the code's: parts that start a nats-server of their own (fsync,
	// accounts) look for it under their working directory.
	if _, err := os.Stat(filepath.Join(repo, ".bin")); err == nil {
		if err := os.Symlink(filepath.Join(repo, ".bin"), filepath.Join(w.dir, ".bin")); err != nil {
			w.remove()
			return nil, err
		}
	}
	return w, nil
}

// remove deletes the worktree and git's record of it. It runs after the
// comparison's context may have ended, so it has a context of its own.
func (w *worktree) remove() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := os.Stat(w.dir); err == nil {
		_ = os.Remove(filepath.Join(w.dir, ".bin")) // the link alone, before anything deletes trees
		if _, err := git(ctx, w.repo, "worktree", "remove", "--force", w.dir); err != nil {
			fmt.Fprintln(os.Stderr, "bench:compare:", err)
		}
	}
	_ = os.RemoveAll(w.parent)
	_, _ = git(ctx, w.repo, "worktree", "prune") // a record left by a removal that failed
}

// build compiles bench/<name> of t into bin, with the flags every other
// build here uses, so that the build cache's packages serve it.
func build(ctx context.Context, t tree, name, bin string) error {
	args := []string{"build", "-o", bin}
	if t.tags != "" {
		args = append(args, "-tags", t.tags)
	}
	args = append(args, "./bench/"+name)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = t.dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go %s in %s: %w\n%s", strings.Join(args, " "), t.dir, err, out)
	}
	return nil
}

// help runs bin -h and reads the flags it lists (flag prints them on
// stderr). Its exit status is not read: a program's own usage function may
// exit 2; a help that lists no flag is the error.
func help(ctx context.Context, bin, dir string) (map[string]flagHelp, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-h")
	cmd.Dir = dir
	out, _ := cmd.CombinedOutput()
	flags := parseHelp(string(out))
	if len(flags) == 0 {
		return nil, fmt.Errorf("%s -h listed no flags:\n%s", bin, out)
	}
	return flags, nil
}

// goflagsWithTags is the environment's GOFLAGS plus -tags, for the runs of
// a side with build tags: bench:search builds `fanout` itself, and must
// build it with the side's tags too.
func goflagsWithTags(tags string) string {
	flags := os.Getenv("GOFLAGS")
	if tags == "" {
		return flags
	}
	return strings.TrimSpace(flags + " -tags=" + tags)
}

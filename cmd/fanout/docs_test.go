package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/fanout/fanout/subscribers/registry"
	"github.com/spf13/cobra"
	"gopkg.in/yaml.v3"
)

// TestDocs checks the commands the docs tell a reader to type: every line of
// a fenced block in README.md and docs/*.md that runs fanout (`go run
// ./cmd/fanout ...`, `./fanout ...` or `fanout ...` at the start of a
// command, after an optional `$ ` prompt and VAR=value prefixes) must name
// a subcommand that exists, with only flags that command defines (its
// parents' persistent flags included) and the arguments it accepts; every
// `go tool task NAME` must name a task of Taskfile.yml; every
// `deploy/services.sh X` (or `bash deploy/services.sh X`) must say up, down
// or status; every `nats ...` or `.bin/nats ...` must parse in the nats CLI
// that deploy/versions.env pins (subcommands, flags, arguments: see
// natsCLI.check), which is built into .bin/ if missing. It runs nothing but
// that CLI's --help.
//
// A fenced block must say what it holds in its info string:
//
//   - sh, bash, shell, zsh: commands, every line checked;
//   - console: a session, only the lines after a `$ ` prompt are commands;
//   - text (program output), go, yaml, json, sql, ...: not checked.
//
// Commands that cannot run on a development machine carry a second word in
// their info string and are not checked: "sh docker" (they need a Docker
// engine) and "sh prod" (they run against a production host or database).
// A block with no info string is an error, so that nothing is skipped by
// accident. docs/testing.md says the same for the docs' writers.
func TestDocs(t *testing.T) {
	t.Parallel()
	docs, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	docs = append([]string{"../../README.md"}, docs...)
	if len(docs) < 2 {
		t.Fatalf("found only %v: the docs test would prove nothing", docs)
	}
	tasks, err := taskfileTasks("../../Taskfile.yml")
	if err != nil {
		t.Fatal(err)
	}
	c := docChecker{root: rootCommand(), tasks: tasks, subscribers: registry.Default.Names(), nats: newNatsCLI(t)}
	for _, path := range docs {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		name := strings.TrimPrefix(filepath.ToSlash(path), "../../")
		for _, problem := range c.checkDoc(name, string(b)) {
			t.Error(problem)
		}
	}
	// Guard: a parser that found nothing would pass every doc.
	if c.fanoutLines < 10 || c.taskLines < 3 || c.servicesLines < 1 || c.natsLines < 2 {
		t.Errorf("checked only %d fanout, %d task, %d services.sh and %d nats commands in %d docs: the parser is missing them, and the test proves less than it claims",
			c.fanoutLines, c.taskLines, c.servicesLines, c.natsLines, len(docs))
	}
	t.Logf("checked %d fanout, %d task, %d services.sh and %d nats commands in %d docs; %d blocks not runnable here skipped",
		c.fanoutLines, c.taskLines, c.servicesLines, c.natsLines, len(docs), c.skippedBlocks)
}

// TestDocsCheckerFindsMistakes feeds the checker a doc with one mistake per
// kind it must catch, and one of each kind it must let through.
func TestDocsCheckerFindsMistakes(t *testing.T) {
	t.Parallel()
	c := docChecker{
		root:        rootCommand(),
		tasks:       map[string]bool{"up": true, "test": true, "bench:relay": true},
		subscribers: registry.Default.Names(),
		nats:        newNatsCLI(t),
	}
	doc := "# x\n\n```sh\n" + strings.Join([]string{
		"go run ./cmd/fanout status --json                 # fine", // line 4
		"go run ./cmd/fanout dlq lst",                              // 5: unknown subcommand
		"go run ./cmd/fanout status --jsn",                         // 6: unknown flag
		"FANOUT_X=1 ./fanout --config f.yaml relay",                // fine: a prefix, a persistent flag before the subcommand
		"fanout dlq show",                                          // 8: missing argument
		"go tool task up && go tool task tset",                     // 9: unknown task
		"go tool task bench:relay -- -only horizon",                // fine
		"bash deploy/services.sh start",                            // 11: not up, down or status
		"deploy/services.sh status",                                // fine
		"go run ./cmd/fanout subscribe invoicing nosuch",           // 13: unknown subscriber
		"go run ./cmd/fanout reindex --check --repair \\",          // fine, continued
		"  --loaders 2",
		"go run ./cmd/fanout dlq",                             // 16: a group, not a command
		"go run ./cmd/fanout replay invoicing --from-time",    // 17: a flag without its value
		".bin/nats stream view EVENTS --last 5",               // 18: a flag v0.5.0 does not have
		"nats stream vew EVENTS",                              // 19: no such subcommand
		"nats str ls --names",                                 // fine: aliases of stream and list
		".bin/nats sub --stream EVENTS --last-per-subject -T", // fine: a short flag
		"nats stream",                       // 22: a group
		"nats stream info EVENTS --timeout", // 23: a flag without its value
		"nats-server --version",             // fine: not the CLI
	}, "\n") + "\n```\n\n```console\n$ fanout config check\nfanout: configuration: relay.batch_size must be ...\n```\n\n" +
		"```sh docker\ndocker compose run --rm operator dlq lst\n```\n\n```\nfanout up\n```\n" // line 36: no info string
	got := c.checkDoc("t.md", doc)
	want := [][2]string{
		{"t.md:5: ", `has no subcommand "lst"`},
		{"t.md:6: ", "unknown flag --jsn"},
		{"t.md:8: ", "accepts 1 arg(s)"},
		{"t.md:9: ", `no task "tset"`},
		{"t.md:11: ", `"start"`},
		{"t.md:13: ", `unknown subscriber "nosuch"`},
		{"t.md:16: ", "name one of its subcommands"},
		{"t.md:17: ", "--from-time needs a value"},
		{"t.md:18: ", "unknown long flag '--last'"},
		{"t.md:19: ", `expected command but got "vew"`},
		{"t.md:22: ", `"nats stream" is not a command by itself`},
		{"t.md:23: ", "expected argument for flag '--timeout'"},
		{"t.md:36: ", "no info string"},
	}
	joined := strings.Join(got, "\n")
	for _, w := range want {
		if !slices.ContainsFunc(got, func(p string) bool { return strings.HasPrefix(p, w[0]) && strings.Contains(p, w[1]) }) {
			t.Errorf("the checker did not report %q at %q; it reported:\n%s", w[1], w[0], joined)
		}
	}
	if len(got) != len(want) {
		t.Errorf("the checker reported %d problems, want %d:\n%s", len(got), len(want), joined)
	}
}

type docChecker struct {
	root        *cobra.Command
	tasks       map[string]bool
	subscribers []string

	nats *natsCLI

	fanoutLines, taskLines, servicesLines, natsLines, skippedBlocks int
}

// checkDoc returns one problem per bad command in the fenced blocks of doc,
// each as "name:line: command: what is wrong".
func (c *docChecker) checkDoc(name, doc string) []string {
	var problems []string
	for _, b := range fencedBlocks(doc) {
		words := strings.Fields(b.info)
		if len(words) == 0 {
			problems = append(problems, fmt.Sprintf("%s:%d: fenced block with no info string: say sh (commands), console ($ lines are commands), text (output) or its language", name, b.line))
			continue
		}
		switch words[0] {
		case "sh", "bash", "shell", "zsh", "console":
		default:
			continue
		}
		if slices.Contains(words[1:], "docker") || slices.Contains(words[1:], "prod") {
			c.skippedBlocks++
			continue
		}
		for _, l := range commandLines(b, words[0] == "console") {
			for _, cmd := range splitCommands(l.text) {
				if err := c.checkCommand(cmd); err != nil {
					problems = append(problems, fmt.Sprintf("%s:%d: %s: %v", name, l.line, strings.Join(cmd, " "), err))
				}
			}
		}
	}
	return problems
}

// checkCommand checks one simple command (its words, VAR=value prefixes
// already removed); commands that are neither fanout, task, services.sh
// nor the nats CLI pass.
func (c *docChecker) checkCommand(words []string) error {
	switch {
	case len(words) >= 2 && words[0] == "go" && words[1] == "run":
		args, ok := goRunFanout(words[2:])
		if !ok {
			return nil
		}
		c.fanoutLines++
		return c.checkFanout(args)
	case words[0] == "fanout" || words[0] == "./fanout":
		c.fanoutLines++
		return c.checkFanout(words[1:])
	case len(words) >= 3 && words[0] == "go" && words[1] == "tool" && words[2] == "task":
		c.taskLines++
		return c.checkTask(words[3:])
	case isServicesScript(words[0]):
		c.servicesLines++
		return checkServices(words[1:])
	case len(words) >= 2 && (words[0] == "bash" || words[0] == "sh") && isServicesScript(words[1]):
		c.servicesLines++
		return checkServices(words[2:])
	case isNatsCLI(words[0]):
		c.natsLines++
		return c.nats.check(words[1:])
	}
	return nil
}

// goRunFanout returns the arguments after the package of `go run [build
// flags] PACKAGE ARGS...`, when the package is fanout's command.
func goRunFanout(words []string) ([]string, bool) {
	valued := map[string]bool{"-tags": true, "-ldflags": true, "-gcflags": true, "-exec": true, "-mod": true, "-modfile": true, "-C": true, "-o": true, "-p": true, "-overlay": true, "-pgo": true}
	for i := 0; i < len(words); i++ {
		w := words[i]
		if strings.HasPrefix(w, "-") {
			if valued[w] {
				i++
			}
			continue
		}
		switch strings.TrimSuffix(w, "/") {
		case "./cmd/fanout", "github.com/fanout/fanout/cmd/fanout":
			return words[i+1:], true
		}
		return nil, false
	}
	return nil, false
}

func isServicesScript(w string) bool {
	return w == "deploy/services.sh" || w == "./deploy/services.sh"
}

func checkServices(args []string) error {
	if len(args) == 0 {
		return nil // the script's default is up
	}
	if !slices.Contains([]string{"up", "down", "status"}, args[0]) {
		return fmt.Errorf("deploy/services.sh takes up, down or status, not %q", args[0])
	}
	return nil
}

func (c *docChecker) checkTask(args []string) error {
	valued := map[string]bool{"-d": true, "--dir": true, "-t": true, "--taskfile": true, "-o": true, "--output": true}
	var named bool
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			i = len(args) // CLI_ARGS, for the task's program
		case strings.HasPrefix(a, "-"):
			if valued[a] {
				i++
			}
			named = true // --list, --version, ...: task's own business
		case strings.Contains(a, "="):
			// a variable: DURATION=2m
		default:
			named = true
			if !c.tasks[a] {
				return fmt.Errorf("Taskfile.yml has no task %q (it has: %s)", a, strings.Join(sortedKeys(c.tasks), ", "))
			}
		}
	}
	if !named && !c.tasks["default"] {
		return fmt.Errorf("names no task, and Taskfile.yml has no default task")
	}
	return nil
}

// checkFanout walks args down the command tree as cobra would, and checks
// the subcommands, the flags and the number of arguments.
func (c *docChecker) checkFanout(args []string) error {
	cmd, path := c.root, "fanout"
	var positional, flags []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			positional = append(positional, args[i+1:]...)
			break
		}
		if strings.HasPrefix(a, "-") && a != "-" {
			name, needsValue, err := lookupFlag(cmd, a)
			if err != nil {
				return fmt.Errorf("%s: %w", path, err)
			}
			if needsValue {
				if i+1 >= len(args) {
					return fmt.Errorf("%s: flag --%s needs a value", path, name)
				}
				i++
			}
			flags = append(flags, a)
			continue
		}
		if len(positional) == 0 {
			if sub := findSubcommand(cmd, a); sub != nil {
				cmd, path = sub, path+" "+a
				continue
			}
			if cmd.HasAvailableSubCommands() && !cmd.Runnable() {
				return fmt.Errorf("%q has no subcommand %q (it has: %s)", path, a, strings.Join(subcommandNames(cmd), ", "))
			}
		}
		positional = append(positional, a)
	}
	// cobra parses every flag against the command it resolved: a local
	// flag of a parent is not one of its subcommand's.
	for _, a := range flags {
		if _, _, err := lookupFlag(cmd, a); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	if !cmd.Runnable() {
		return fmt.Errorf("%q is not a command by itself: name one of its subcommands (%s)", path, strings.Join(subcommandNames(cmd), ", "))
	}
	if cmd.Args != nil {
		if err := cmd.Args(cmd, positional); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	var names []string
	switch path {
	case "fanout subscribe", "fanout provision":
		names = positional
	case "fanout replay":
		names = positional[:min(1, len(positional))]
	}
	for _, n := range names {
		if !slices.Contains(c.subscribers, n) {
			return fmt.Errorf("%s: unknown subscriber %q (known: %s)", path, n, strings.Join(c.subscribers, ", "))
		}
	}
	return nil
}

// lookupFlag finds the flag a names (--name, --name=value, -x, -xvalue)
// among cmd's own and inherited flags, and says whether its value is the
// next argument.
func lookupFlag(cmd *cobra.Command, a string) (name string, needsValue bool, err error) {
	cmd.InitDefaultHelpFlag()
	if long, ok := strings.CutPrefix(a, "--"); ok {
		long, _, inline := strings.Cut(long, "=")
		f := cmd.LocalFlags().Lookup(long)
		if f == nil {
			f = cmd.InheritedFlags().Lookup(long)
		}
		if f == nil {
			return "", false, fmt.Errorf("unknown flag --%s (its flags: %s)", long, strings.Join(flagNames(cmd), ", "))
		}
		return f.Name, !inline && f.NoOptDefVal == "", nil
	}
	short := a[1:2]
	f := cmd.LocalFlags().ShorthandLookup(short)
	if f == nil {
		f = cmd.InheritedFlags().ShorthandLookup(short)
	}
	if f == nil {
		return "", false, fmt.Errorf("unknown shorthand flag -%s (its flags: %s)", short, strings.Join(flagNames(cmd), ", "))
	}
	return f.Name, len(a) == 2 && f.NoOptDefVal == "", nil
}

func findSubcommand(cmd *cobra.Command, name string) *cobra.Command {
	for _, sub := range cmd.Commands() {
		if sub.Name() == name || sub.HasAlias(name) {
			return sub
		}
	}
	return nil
}

func subcommandNames(cmd *cobra.Command) []string {
	var names []string
	for _, sub := range cmd.Commands() {
		names = append(names, sub.Name())
	}
	sort.Strings(names)
	return names
}

// flagUsageRE finds each flag's long name in cobra's usage lines
// ("  -h, --help   help for status").
var flagUsageRE = regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([\w-]+)`)

func flagNames(cmd *cobra.Command) []string {
	var names []string
	for _, m := range flagUsageRE.FindAllStringSubmatch(cmd.LocalFlags().FlagUsages()+cmd.InheritedFlags().FlagUsages(), -1) {
		names = append(names, "--"+m[1])
	}
	sort.Strings(names)
	return names
}

func sortedKeys(m map[string]bool) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func taskfileTasks(path string) (map[string]bool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var tf struct {
		Tasks map[string]yaml.Node `yaml:"tasks"`
	}
	if err := yaml.Unmarshal(b, &tf); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(tf.Tasks) == 0 {
		return nil, fmt.Errorf("%s: no tasks found", path)
	}
	tasks := map[string]bool{}
	for name := range tf.Tasks {
		tasks[name] = true
	}
	return tasks, nil
}

// block is a fenced code block: its info string, the line of its opening
// fence (1-based) and its lines, each with its line number.
type block struct {
	info  string
	line  int
	lines []docLine
}

type docLine struct {
	line int
	text string
}

var fenceRE = regexp.MustCompile("^( *)(`{3,}|~{3,})(.*)$")

// fencedBlocks returns the fenced code blocks of a Markdown document,
// including those indented inside list items.
func fencedBlocks(doc string) []block {
	var blocks []block
	var cur *block
	var fence string
	var indent int
	for i, text := range strings.Split(doc, "\n") {
		if cur == nil {
			if m := fenceRE.FindStringSubmatch(text); m != nil && !(m[2][0] == '`' && strings.Contains(m[3], "`")) {
				cur = &block{info: strings.TrimSpace(m[3]), line: i + 1}
				fence, indent = m[2], len(m[1])
			}
			continue
		}
		trimmed := strings.TrimSpace(text)
		if strings.HasPrefix(trimmed, fence) && strings.Trim(trimmed, fence[:1]) == "" {
			blocks = append(blocks, *cur)
			cur = nil
			continue
		}
		for n := 0; n < indent && strings.HasPrefix(text, " "); n++ {
			text = text[1:]
		}
		cur.lines = append(cur.lines, docLine{line: i + 1, text: text})
	}
	return blocks
}

// commandLines returns the block's commands: lines joined where they end
// in a backslash, the `$ ` prompt removed; in a console block only the
// lines with a prompt.
func commandLines(b block, console bool) []docLine {
	var out []docLine
	for i := 0; i < len(b.lines); i++ {
		l := b.lines[i]
		text := strings.TrimSpace(l.text)
		prompted := strings.HasPrefix(text, "$ ")
		if console && !prompted {
			continue
		}
		text = strings.TrimPrefix(text, "$ ")
		for strings.HasSuffix(text, "\\") && i+1 < len(b.lines) {
			i++
			text = strings.TrimSuffix(text, "\\") + " " + strings.TrimSpace(b.lines[i].text)
		}
		out = append(out, docLine{line: l.line, text: text})
	}
	return out
}

var assignmentRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`)

// splitCommands splits a shell line into its simple commands (at unquoted
// ;, &, &&, | and ||), each as its words with quotes removed, the
// VAR=value prefixes dropped, and comments and redirections left out.
func splitCommands(line string) [][]string {
	var cmds [][]string
	var words []string
	var word strings.Builder
	inWord, redirect := false, false
	endWord := func() {
		if inWord {
			if redirect {
				redirect = false // the redirection's target
			} else {
				words = append(words, word.String())
			}
		}
		word.Reset()
		inWord = false
	}
	endCommand := func() {
		endWord()
		for len(words) > 0 && assignmentRE.MatchString(words[0]) {
			words = words[1:]
		}
		if len(words) > 0 {
			cmds = append(cmds, words)
		}
		words = nil
	}
	var quote rune
	runes := []rune(line)
	for i := 0; i < len(runes); i++ {
		r := runes[i]
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			} else if r == '\\' && quote == '"' && i+1 < len(runes) {
				i++
				word.WriteRune(runes[i])
			} else {
				word.WriteRune(r)
			}
		case r == '\'' || r == '"':
			quote, inWord = r, true
		case r == '\\' && i+1 < len(runes):
			i++
			word.WriteRune(runes[i])
			inWord = true
		case r == ' ' || r == '\t':
			endWord()
		case r == '#' && !inWord:
			endCommand()
			return cmds
		case r == ';' || r == '&' || r == '|':
			endCommand()
			if i+1 < len(runes) && runes[i+1] == r {
				i++
			}
		case r == '>' || r == '<':
			if inWord && strings.Trim(word.String(), "0123456789") == "" {
				word.Reset() // a file descriptor: 2>
				inWord = false
			}
			endWord()
			if i+1 < len(runes) && (runes[i+1] == '&' || runes[i+1] == '>') {
				i++
			}
			redirect = true
		default:
			word.WriteRune(r)
			inWord = true
		}
	}
	endCommand()
	return cmds
}

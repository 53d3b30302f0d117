// Package deploy writes fanout's deployment files from the subscribers'
// declarations: the NATS server configuration (a user and permissions per
// subscriber), the Postgres roles script (a role, grants and row-level
// policies per subscriber), the compose file (a service and secrets per
// subscriber) and the script that generates the secrets. The files in
// deploy/ are its output (`fanout deploy render deploy`); a test fails when
// they drift from what the registry declares.
package deploy

import (
	"bytes"
	"embed"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/template"

	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
)

//go:embed templates/*.tmpl
var templates embed.FS

// File is one deployment file.
type File struct {
	// Name is what `fanout deploy` calls it.
	Name string
	// Path is where it lives under the deploy directory.
	Path string
	Mode os.FileMode
	tmpl string
}

// Files are the files fanout derives, in the order they are written.
var Files = []File{
	{Name: "nats-config", Path: "nats/nats-server.conf", Mode: 0o644, tmpl: "nats-server.conf.tmpl"},
	{Name: "nats-cluster-config", Path: "nats/cluster.conf", Mode: 0o644, tmpl: "cluster.conf.tmpl"},
	{Name: "postgres-roles", Path: "postgres/roles.sql", Mode: 0o644, tmpl: "roles.sql.tmpl"},
	{Name: "postgres-hba", Path: "postgres/pg_hba.conf", Mode: 0o644, tmpl: "pg_hba.conf.tmpl"},
	{Name: "compose", Path: "compose.yaml", Mode: 0o644, tmpl: "compose.yaml.tmpl"},
	{Name: "secrets-script", Path: "secrets/generate.sh", Mode: 0o755, tmpl: "generate.sh.tmpl"},
}

// sharedTemplates holds the parts several files share (both NATS
// configurations' accounts and users).
const sharedTemplates = "nats-accounts.conf.tmpl"

// Lookup returns the file called name.
func Lookup(name string) (File, error) {
	var names []string
	for _, f := range Files {
		if f.Name == name {
			return f, nil
		}
		names = append(names, f.Name)
	}
	return File{}, fmt.Errorf("unknown deployment file %q (known: %s)", name, strings.Join(names, ", "))
}

// subscriber is what the templates know of one subscriber.
type subscriber struct {
	Name       string
	Env        string // the name in environment variables: INVOICING
	EventTypes []string
	Grants     []string
	Redis      bool
	Search     bool
	Ordered    bool
	Backfill   bool
}

type data struct {
	Subscribers       []subscriber
	SearchSubscribers []subscriber
	// Tables are the subscribers' own tables (Declaration.Tables), sorted.
	Tables []string
	// OperatorReindexConsumer is the consumer `fanout reindex` reads the
	// events stream through, as the operator.
	OperatorReindexConsumer string
	// RelayAuditConsumers are the consumers the relay's audit and fanout
	// audit read the events stream through, as the relay.
	RelayAuditConsumers []string
	// ReaderConsumers are those and the reindex's: the consumers only
	// the provisioner creates, and their users only move and pull.
	ReaderConsumers []string
	// HBAConnectionTypes are the kinds of pg_hba.conf line: Unix socket
	// (no address) and TCP.
	HBAConnectionTypes []hbaConnectionType
}

type hbaConnectionType struct{ Type, Address string }

func newData(decls []subscribers.Declaration) data {
	d := data{OperatorReindexConsumer: stream.ReindexConsumer,
		RelayAuditConsumers: []string{stream.AuditConsumer, stream.AuditCommandConsumer},
		ReaderConsumers:     []string{stream.AuditConsumer, stream.AuditCommandConsumer, stream.ReindexConsumer},
		HBAConnectionTypes:  []hbaConnectionType{{"local", "         "}, {"host ", "all      "}}}
	for _, decl := range decls {
		s := subscriber{
			Name:       decl.Name,
			Env:        strings.ToUpper(decl.Name),
			EventTypes: decl.EventTypes,
			Grants:     decl.AllGrants(),
			Redis:      decl.UsesService(subscribers.Redis),
			Search:     decl.UsesService(subscribers.Search),
			Ordered:    decl.Ordered,
			Backfill:   decl.Backfill != nil,
		}
		d.Subscribers = append(d.Subscribers, s)
		d.Tables = append(d.Tables, decl.Tables...)
		if s.Search {
			d.SearchSubscribers = append(d.SearchSubscribers, s)
		}
	}
	slices.Sort(d.Tables)
	d.Tables = slices.Compact(d.Tables)
	return d
}

// Render returns f's content for the subscribers decls.
func (f File) Render(decls []subscribers.Declaration) ([]byte, error) {
	t, err := template.New(f.tmpl).Funcs(template.FuncMap{"join": strings.Join}).
		Option("missingkey=error").ParseFS(templates, "templates/"+f.tmpl, "templates/"+sharedTemplates)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	if err := t.Execute(&buf, newData(decls)); err != nil {
		return nil, fmt.Errorf("render %s: %w", f.Path, err)
	}
	return buf.Bytes(), nil
}

// RenderAll writes every file under dir, and returns the paths it changed.
func RenderAll(dir string, decls []subscribers.Declaration) (changed []string, err error) {
	for _, f := range Files {
		content, err := f.Render(decls)
		if err != nil {
			return changed, err
		}
		path := filepath.Join(dir, f.Path)
		if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, content) {
			continue
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return changed, err
		}
		if err := os.WriteFile(path, content, f.Mode); err != nil {
			return changed, err
		}
		// WriteFile keeps an existing file's mode.
		if err := os.Chmod(path, f.Mode); err != nil {
			return changed, err
		}
		changed = append(changed, path)
	}
	return changed, nil
}

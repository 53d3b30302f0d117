package registry_test

import (
	"strings"
	"testing"

	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/registry"
)

// A subscriber may not take the name of another NATS user or account of the
// deployment, nor the operator's consumer prefix: it would share their
// permissions (deploy/nats/nats-server.conf).
func TestReservedNamesAreRefused(t *testing.T) {
	for _, name := range []string{"relay", "provisioner", "operator", "admin", "admin_deadletter", "events", "deadletter", "operator_reindex_searchindex", "operator_x", "relay_audit", "relay_x"} {
		d := invoicing.Subscriber
		d.Name = name
		_, err := registry.Default.With(d)
		if err == nil || !strings.Contains(err.Error(), "reserved") {
			t.Errorf("subscriber %q: %v, want refused as reserved", name, err)
		}
	}
	d := invoicing.Subscriber
	d.Name = "operations" // a prefix of a reserved word, not the reserved prefix
	if _, err := registry.Default.With(d); err != nil {
		t.Errorf("subscriber %q: %v", d.Name, err)
	}
}

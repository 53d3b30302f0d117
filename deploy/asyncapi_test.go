package deploy_test

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/fanout/fanout/deploy"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/registry"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"gopkg.in/yaml.v3"
)

// asyncAPISchema is AsyncAPI's published JSON Schema of its 3.0.0
// documents, from the npm package @asyncapi/specs 6.11.1
// (schemas/3.0.0-without-$id.json, Apache-2.0), minified.
const asyncAPISchema = "testdata/asyncapi-3.0.0.schema.json"

// deploy/asyncapi.yaml is what the declarations say, and a valid AsyncAPI
// 3.0 document: a channel on events.<type> for every declared type, sent
// by the relay and received by every subscriber whose filters take it.
func TestAsyncAPIDocument(t *testing.T) {
	want, err := deploy.AsyncAPI(shop.EventTypes, registry.Default.All(), "events")
	if err != nil {
		t.Fatal(err)
	}
	have, err := os.ReadFile(deploy.AsyncAPIPath)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(have, want) {
		t.Errorf("%s differs from the declarations (first difference at line %d): run `go run ./cmd/fanout events asyncapi > deploy/asyncapi.yaml`",
			deploy.AsyncAPIPath, firstDifference(have, want))
	}

	validate := compileAsyncAPISchema(t)
	doc := asJSON(t, want)
	if err := validate.Validate(doc); err != nil {
		t.Fatalf("not a valid AsyncAPI 3.0.0 document: %v", err)
	}
	// The validator is not vacuous: an operation with an action AsyncAPI
	// does not know is refused.
	broken := asJSON(t, bytes.Replace(want, []byte("action: receive"), []byte("action: consume"), 1))
	if err := validate.Validate(broken); err == nil {
		t.Error("a document with the action consume passed the AsyncAPI schema")
	}

	var d struct {
		Channels   map[string]struct{ Address string }
		Operations map[string]struct {
			Action  string
			Channel struct {
				Ref string `yaml:"$ref"`
			}
		}
	}
	if err := yaml.Unmarshal(want, &d); err != nil {
		t.Fatal(err)
	}
	for _, ty := range shop.EventTypes.Types() {
		if got := d.Channels[ty.Name].Address; got != "events."+ty.Name {
			t.Errorf("channel of %s: address %q", ty.Name, got)
		}
		if op := d.Operations["relay.send."+ty.Name]; op.Action != "send" || op.Channel.Ref != "#/channels/"+ty.Name {
			t.Errorf("the relay's send of %s: %+v", ty.Name, op)
		}
	}
	for _, name := range []string{"invoicing.receive.order.created", "fulfilment.receive.order.paid", "cacheinval.receive.product.updated", "searchindex.receive.brand.updated"} {
		if op := d.Operations[name]; op.Action != "receive" {
			t.Errorf("operation %s: %+v", name, op)
		}
	}
	if _, ok := d.Operations["invoicing.receive.order.paid"]; ok {
		t.Error("invoicing receives order.paid, which its filters do not take")
	}
}

func compileAsyncAPISchema(t *testing.T) *jsonschema.Schema {
	t.Helper()
	raw, err := os.ReadFile(asyncAPISchema)
	if err != nil {
		t.Fatal(err)
	}
	schema, err := jsonschema.UnmarshalJSON(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("asyncapi-3.0.0.json", schema); err != nil {
		t.Fatal(err)
	}
	s, err := c.Compile("asyncapi-3.0.0.json")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// asJSON reads a YAML document as the JSON value it stands for.
func asJSON(t *testing.T, doc []byte) any {
	t.Helper()
	var v any
	if err := yaml.Unmarshal(doc, &v); err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	out, err := jsonschema.UnmarshalJSON(strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return out
}

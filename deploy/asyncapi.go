package deploy

// The AsyncAPI document of the events: what a team in any language needs
// to consume them, derived from the event types' declarations and the
// subscribers' (deploy/asyncapi.yaml, `fanout events asyncapi`).

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/fanout/fanout/events"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/wire"
	"github.com/nats-io/nats.go/jetstream"
	"gopkg.in/yaml.v3"
)

// AsyncAPIPath is where the document lives under the deploy directory.
const AsyncAPIPath = "asyncapi.yaml"

// asyncAPI is an AsyncAPI 3.0 document, as far as fanout fills one.
type asyncAPI struct {
	AsyncAPI           string                    `yaml:"asyncapi"`
	Info               asyncInfo                 `yaml:"info"`
	DefaultContentType string                    `yaml:"defaultContentType"`
	Servers            map[string]asyncServer    `yaml:"servers"`
	Channels           map[string]asyncChannel   `yaml:"channels"`
	Operations         map[string]asyncOperation `yaml:"operations"`
	Components         asyncComponents           `yaml:"components"`
}

type asyncInfo struct {
	Title       string `yaml:"title"`
	Version     string `yaml:"version"`
	Description string `yaml:"description"`
}

type asyncServer struct {
	Host        string `yaml:"host"`
	Protocol    string `yaml:"protocol"`
	Description string `yaml:"description"`
}

type ref struct {
	Ref string `yaml:"$ref"`
}

type asyncChannel struct {
	Address     string         `yaml:"address"`
	Description string         `yaml:"description"`
	Messages    map[string]ref `yaml:"messages"`
}

type asyncOperation struct {
	Action      string `yaml:"action"`
	Channel     ref    `yaml:"channel"`
	Summary     string `yaml:"summary"`
	Description string `yaml:"description,omitempty"`
	Messages    []ref  `yaml:"messages"`
}

type asyncComponents struct {
	Messages map[string]asyncMessage `yaml:"messages"`
	Schemas  map[string]any          `yaml:"schemas"`
}

type asyncMessage struct {
	Name        string       `yaml:"name"`
	Title       string       `yaml:"title"`
	Summary     string       `yaml:"summary"`
	ContentType string       `yaml:"contentType"`
	Headers     ref          `yaml:"headers"`
	Payload     asyncPayload `yaml:"payload"`
}

type asyncPayload struct {
	SchemaFormat string `yaml:"schemaFormat"`
	Schema       any    `yaml:"schema"`
}

// AsyncAPI renders the document: a channel a declared event type (its
// subject under prefix), the message with its headers and its payload's
// schema as declared, the relay's send of it, and each subscriber's
// receive of the types its filters take.
func AsyncAPI(types *events.Catalog, decls []subscribers.Declaration, prefix string) ([]byte, error) {
	doc := asyncAPI{
		AsyncAPI: "3.0.0",
		Info: asyncInfo{
			Title:   "fanout events",
			Version: "1.0.0",
			Description: "The events fanout's relay publishes to the JetStream stream, one message per committed outbox row " +
				"(Nats-Msg-Id is the event's origin and outbox id, so JetStream drops a duplicate), and the subscribers that read them. " +
				"Generated from shop/eventtypes and the subscriber registry by `fanout events asyncapi`.",
		},
		DefaultContentType: "application/json",
		Servers: map[string]asyncServer{
			"nats": {Host: "nats:4222", Protocol: "nats", Description: "The NATS server with JetStream (TLS, a user for each role: deploy/nats/nats-server.conf)."},
		},
		Channels:   map[string]asyncChannel{},
		Operations: map[string]asyncOperation{},
		Components: asyncComponents{Messages: map[string]asyncMessage{}, Schemas: map[string]any{"headers": headersSchema()}},
	}
	for _, t := range types.Types() {
		var schema any
		if err := json.Unmarshal(t.Schema, &schema); err != nil {
			return nil, fmt.Errorf("the declaration of %s: %w", t.Name, err)
		}
		doc.Components.Messages[t.Name] = asyncMessage{
			Name: t.Name, Title: t.Name, Summary: t.Description, ContentType: "application/json",
			Headers: ref{"#/components/schemas/headers"},
			Payload: asyncPayload{SchemaFormat: "application/schema+json;version=draft-2020-12", Schema: schema},
		}
		message := ref{"#/channels/" + t.Name + "/messages/" + t.Name}
		doc.Channels[t.Name] = asyncChannel{
			Address:     stream.Subject(prefix, t.Name),
			Description: fmt.Sprintf("%s events, of aggregate %s (schema version %d).", t.Name, t.AggregateType, t.Version),
			Messages:    map[string]ref{t.Name: {"#/components/messages/" + t.Name}},
		}
		doc.Operations["relay.send."+t.Name] = asyncOperation{
			Action: "send", Channel: ref{"#/channels/" + t.Name}, Messages: []ref{message},
			Summary: "The relay publishes each committed outbox row of this type, in commit order within its aggregate.",
		}
		for _, d := range decls {
			if !d.Reads(t.Name) {
				continue
			}
			op := asyncOperation{
				Action: "receive", Channel: ref{"#/channels/" + t.Name}, Messages: []ref{message},
				Summary: fmt.Sprintf("%s reads these events through its durable consumer %s, each once.", d.Name, d.Name),
			}
			if d.Ordered {
				op.Description = "In order within each aggregate (" + wire.AggregateSeqHeader + "), one instance at a time (a pinned client)."
			}
			doc.Operations[d.Name+".receive."+t.Name] = op
		}
	}
	var b strings.Builder
	b.WriteString("# Generated by `fanout events asyncapi` from shop/eventtypes and the subscriber\n# registry: do not edit (a test fails when it drifts).\n")
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(doc); err != nil {
		return nil, err
	}
	if err := enc.Close(); err != nil {
		return nil, err
	}
	return []byte(b.String()), nil
}

// headersSchema describes the headers the relay sets on every event.
func headersSchema() map[string]any {
	str := func(desc string) map[string]any { return map[string]any{"type": "string", "description": desc} }
	return map[string]any{
		"type":     "object",
		"required": []string{jetstream.MsgIDHeader, wire.EventIDHeader, wire.OriginHeader, wire.EventTypeHeader, wire.AggregateTypeHeader, wire.AggregateIDHeader, wire.CreatedAtHeader},
		"properties": map[string]any{
			jetstream.MsgIDHeader:    str("<origin>:<outbox id>: the event's identity; JetStream drops a second message with it within the duplicate window."),
			wire.EventIDHeader:       str("The outbox row's id, a decimal integer."),
			wire.OriginHeader:        str("<system identifier>/<database>/<epoch>: the database the event came from and its outbox epoch."),
			wire.EventTypeHeader:     str("The event type, as in the subject."),
			wire.AggregateTypeHeader: str("The type of the aggregate the event is about."),
			wire.AggregateIDHeader:   str("The aggregate's id."),
			wire.AggregateSeqHeader:  str("The event's number within its aggregate (1, 2, ...), in commit order, with no gaps; absent on types the outbox does not number."),
			wire.CreatedAtHeader:     str("The outbox row's created_at (RFC 3339): its writer's transaction."),
			wire.RepairedHeader:      str("Set on an event published again because the stream lost it: the sequence it was lost from."),
			wire.TxHeader:            str("With relay.atomic transaction: the writer transaction the event came from."),
			wire.TxChunkHeader:       str("With relay.atomic transaction: the chunk of the transaction (1, 2, ...) the event's atomic batch carried."),
			wire.TxLastHeader:        str("With relay.atomic transaction: true on the last chunk's events."),
		},
	}
}

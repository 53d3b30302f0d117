// Package stream describes the JetStream stream that carries fanout's
// events: its settings (the stream.* keys), its subjects
// (<prefix>.<event_type>, each token checked), and the shape that
// provisioning creates and verifies. The relay publishes into it and the
// subscribers read from it; both import this package, and it imports
// neither.
package stream

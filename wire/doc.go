// Package wire is an event on the wire: the one place that names every
// header fanout sets, encodes an outbox row into the NATS message the
// relays publish (Encode), and reads an event back from a message
// (Decode). The relay, the auditor, the subscriber runtime, the dead
// letters and the operator tools all go through it, so that what one
// writes the others read, and a header's name is spelled once.
//
// It imports the outbox's types and rules (a row as claimed, the
// database's identity, the writer's validation) and the stream's subjects,
// and nothing above them.
package wire

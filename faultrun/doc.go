// Package faultrun is the whole-pipeline fault-injection run (`go tool task
// chaos`, and TestChaos with a short default): every role as its own
// fanout process against real services, a writer load with planted bad
// input, faults on a seeded schedule, then a drain and the invariants of
// the design checked one by one.
//
// Its checker reads the outbox, the stream and the subscribers' tables
// with SQL and JetStream requests of its own, not through the stores and
// the wire codec the roles run on: a judge that went through the code it
// judges would share its mistakes. Its planted bad rows are inserted by
// plain SQL too, as a writer in another language would.
package faultrun

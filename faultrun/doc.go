// Package faultrun is the whole-pipeline fault-injection run (`go tool task
// chaos`, and TestChaos with a short default): every role as its own
// fanout process against real services, a writer load with planted bad
// input, faults on a seeded schedule, then a drain and the invariants of
// the design checked one by one.
package faultrun

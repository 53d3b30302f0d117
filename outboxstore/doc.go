// Package outboxstore holds every query on the outbox's tables besides the
// writers' own inserts (package outbox): the outbox and its ranges,
// outbox_default, outbox_partitions, outbox_landings, outbox_audits and
// relay_capture. Each is a constant beside the method that runs it and the
// reasoning behind it: the relays' claims (claim.go, transactions.go),
// the marks that record a batch's outcomes and the reaper's (record.go),
// what a wal relay reads and marks and its slot's record (capture.go),
// retention (retention.go), the auditor's landings and audits (audit.go),
// the database's identity and epochs (identity.go), the numbering trigger
// (numbering.go), and what status, the metrics and the operator commands
// read and change (status.go, operator.go). Package relay, the operator
// tools, the benchmarks and the fault run run no SQL on these tables of
// their own. A role needs only the grants of the methods it calls (see
// deploy/postgres/roles.sql).
package outboxstore

package stream

// The consumers fanout makes on its streams, besides each subscriber's
// durable consumer (named after the subscriber, which may start with
// neither prefix below). They are named here, in one place, so that the
// NATS permissions (package deploy) give each role its own consumers and
// no other's.
const (
	// RelayConsumerPrefix starts the name of every consumer the relay
	// makes: the auditor's reads of the stream.
	RelayConsumerPrefix = "relay_"
	// OperatorConsumerPrefix starts the name of every consumer an operator
	// command makes.
	OperatorConsumerPrefix = "operator_"

	// AuditConsumer is the consumer the relay's auditor reads long runs of
	// the stream through; AuditCommandConsumer is fanout audit's.
	AuditConsumer        = RelayConsumerPrefix + "audit"
	AuditCommandConsumer = RelayConsumerPrefix + "audit_command"
	// ReindexConsumer is the consumer `fanout reindex` reads the stream
	// through while it builds a new index.
	ReindexConsumer = OperatorConsumerPrefix + "reindex_searchindex"
)

package wire

// The headers the relay sets on every event, besides any headers the
// writer gave. Nats-Msg-Id (JetStream's own, so that the server drops
// duplicates) is MsgID: the event's origin and id.
const (
	EventIDHeader       = "Fanout-Event-Id"
	EventTypeHeader     = "Fanout-Event-Type"
	AggregateTypeHeader = "Fanout-Aggregate-Type"
	AggregateIDHeader   = "Fanout-Aggregate-Id"
	CreatedAtHeader     = "Fanout-Created-At"
	// AggregateSeqHeader is the event's number within its aggregate: 1, 2,
	// 3, ... in the order the writers' transactions committed, with no gaps
	// (schema migration 00009 numbers every row as it is inserted). Absent
	// on events written before that migration, and on types the outbox
	// does not number.
	AggregateSeqHeader = "Fanout-Aggregate-Seq"
	// OriginHeader carries the origin of an event: the database it came
	// from and its outbox epoch, "<system identifier>/<database>/<epoch>"
	// (outbox.Origin). An event's identity is its origin and its id, so
	// JetStream never drops one database's event as a duplicate of
	// another's (schema migration 00015).
	OriginHeader = "Fanout-Origin"
	// RepairedHeader is set on an event the auditor published again
	// because the stream had lost it: the sequence it was lost from ("0":
	// published with no landing recorded). A wal relay that decodes again
	// an event it had published sets it too (outboxstore.Claimed.LandedSeq):
	// JetStream drops that copy as a duplicate, unless the stream lost the
	// earlier one. Such a copy enters the stream after later events of its
	// aggregate; the ordered subscribers hold those back until it arrives
	// (subscribers.gap_wait).
	RepairedHeader = "Fanout-Repaired-From"
	// With relay.atomic transaction, the writer transaction an event came
	// from (its commit's position in the write-ahead log), the chunk of it
	// the event's atomic batch carried (1, 2, ...: a transaction of more
	// than 1000 events goes in chunks of 1000), and, on the last chunk's
	// events, "true".
	TxHeader      = "Fanout-Tx"
	TxChunkHeader = "Fanout-Tx-Chunk"
	TxLastHeader  = "Fanout-Tx-Last"
)

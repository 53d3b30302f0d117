package subscribers

// The runner's pull from its consumer, and the connection each message
// came on.
//
// A reply to JetStream (an ack, a term) names its message by stream
// sequence alone. A nats-server restarted from a store that lost messages
// it had acknowledged (a disk that lost its last writes, a store restored
// from a copy) gives their sequences to new messages, and a reply sent
// for a message delivered before would settle a new one that no handler
// saw: lost, neither handled nor dead-lettered. So the runtime settles a
// message only on the connection it came on. The feed opens its iterator
// anew on each connection (the client's reconnect count names it); a
// message keeps the number of the connection its iterator was opened on,
// and its ack or term is not sent once the connection is another one:
// JetStream redelivers it after the ack wait, and the checkpoint (or its
// dead letter's message id) absorbs it then. A role's connection keeps
// nothing to send while disconnected (internal/connect), so a reply
// cannot wait in a buffer for the next connection either.

import (
	"context"
	"errors"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// feed is the runner's iterator over its consumer, opened again on each
// new connection.
type feed struct {
	cons jetstream.Consumer
	pull []jetstream.PullMessagesOpt
	conn *nats.Conn

	mu   sync.Mutex
	iter jetstream.MessagesContext
	gen  uint64 // the connection iter was opened on
	// ending: drained or stopped, not opened again.
	ending bool
}

func openFeed(cons jetstream.Consumer, conn *nats.Conn, pull []jetstream.PullMessagesOpt) (*feed, error) {
	f := &feed{cons: cons, pull: pull, conn: conn}
	return f, f.open()
}

// open opens an iterator on the connection as it is now. The count is
// read first: a reconnect in between leaves the iterator's messages on a
// connection newer than the one they are named for, whose replies are
// then held back (and the iterator opened again): a redelivery, never a
// wrong settle.
func (f *feed) open() error {
	gen := f.conn.Stats().Reconnects
	iter, err := f.cons.Messages(f.pull...)
	if err != nil {
		return err
	}
	f.iter, f.gen = iter, gen
	return nil
}

// next is the iterator's Next. On a new connection it first stops the
// iterator and opens another: what the old one held comes back after the
// ack wait. Only one goroutine calls next.
func (f *feed) next(opts ...jetstream.NextOpt) (jetstream.Msg, error) {
	f.mu.Lock()
	if !f.ending && f.conn.Stats().Reconnects != f.gen {
		f.iter.Stop()
		if err := f.open(); err != nil {
			f.mu.Unlock()
			return nil, err
		}
	}
	iter, gen := f.iter, f.gen
	f.mu.Unlock()
	m, err := iter.Next(opts...)
	if err != nil {
		return nil, err
	}
	return &connMsg{Msg: m, conn: f.conn, gen: gen}, nil
}

// drain pulls no more; what the client holds is still returned by next.
func (f *feed) drain() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ending = true
	f.iter.Drain()
}

// stop ends the iterator at once.
func (f *feed) stop() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ending = true
	f.iter.Stop()
}

// errEarlierConnection: a reply held back (see the top of this file).
var errEarlierConnection = errors.New("not sent: the message came on an earlier connection to NATS, and a server restarted since may have given its sequence to another message; JetStream redelivers it after the ack wait")

// connMsg is a message with the connection it came on; its ack and term
// go only on that connection. In-progress signals and naks go always: on
// another message they only delay or hasten its delivery.
type connMsg struct {
	jetstream.Msg
	conn *nats.Conn
	gen  uint64
}

func (m *connMsg) current() bool {
	return m.conn.IsConnected() && m.conn.Stats().Reconnects == m.gen
}

func (m *connMsg) Ack() error {
	if !m.current() {
		return errEarlierConnection
	}
	return m.Msg.Ack()
}

func (m *connMsg) DoubleAck(ctx context.Context) error {
	if !m.current() {
		return errEarlierConnection
	}
	return m.Msg.DoubleAck(ctx)
}

func (m *connMsg) Term() error {
	if !m.current() {
		return errEarlierConnection
	}
	return m.Msg.Term()
}

func (m *connMsg) TermWithReason(reason string) error {
	if !m.current() {
		return errEarlierConnection
	}
	return m.Msg.TermWithReason(reason)
}

package relay

import (
	"errors"
	"strconv"
	"testing"

	"github.com/fanout/fanout/stream"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The sabotage hook SplitTransactions sends a transaction as two atomic
// batches 200 ms apart. A relay stopping between them sent no second half
// and answered no error and no stream sequences, which the chunk's publish
// read as every event stored, indexing sequences that were not there: a
// panic that took down the relay's tests in an empty-cache CI run. The
// half not sent is an error, so the rows go back to wait.
func TestASplitTransactionCutByAStopIsNotReportedStored(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	h.cfg.Relay.Atomic = AtomicTransaction
	r := h.newRelay(nil, nil)
	r.hooks.SplitTransactions = true

	cfg := stream.JetStreamConfig(h.cfg.Stream)
	cfg.AllowAtomicPublish = true
	js, err := jetstream.New(h.connect())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(t.Context(), cfg); err != nil {
		t.Fatal(err)
	}
	if err := r.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	msgs := make([]*nats.Msg, 4)
	for i := range msgs {
		msgs[i] = nats.NewMsg(stream.Subject(h.cfg.Stream.SubjectPrefix, "product.updated"))
		msgs[i].Header.Set(jetstream.MsgIDHeader, "split-"+strconv.Itoa(i))
		msgs[i].Data = []byte(`{}`)
	}
	seqs, err := r.publisher.sendTransaction(t.Context(), t.Context(), msgs)
	if err == nil {
		t.Fatalf("a transaction whose second half was never sent reads as stored, at sequences %v", seqs)
	}
	if !errors.Is(err, errRelayStopping) {
		t.Errorf("error %q, want it to say the relay was stopping", err)
	}
	info, err := js.Stream(t.Context(), cfg.Name)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != 2 {
		t.Errorf("the stream holds %d messages, want the first half's 2 (the test checks the stop came between the halves)", n)
	}
}

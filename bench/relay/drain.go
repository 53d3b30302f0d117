package main

// The drain: how fast the relay empties an outbox that filled while it was
// stopped, in poll and in wal capture, against a naive publisher and raw
// JetStream publishing (parts a, w, b and c).

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/wire"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// counter counts published rows and can wait for a total.
type counter struct {
	relay.NopObserver
	n          atomic.Int64
	claims     atomic.Int64
	claimNanos atomic.Int64
}

func (c *counter) Claimed(n int, took time.Duration) { c.claims.Add(1); c.claimNanos.Add(int64(took)) }

func (c *counter) Published(ev []relay.Published) { c.n.Add(int64(len(ev))) }

func benchDrain(ctx context.Context, nc *nats.Conn) (result, error) {
	return drainWith(ctx, nc, false, func(*relay.Config) {})
}

// benchDrainWAL measures a wal relay draining its slot: a relay creates
// the slot and stops, rows are committed in transactions of 1000, and a new
// relay publishes them from the slot.
func benchDrainWAL(ctx context.Context, nc *nats.Conn) (result, error) {
	return drainWith(ctx, nc, true, func(*relay.Config) {})
}

// drainWith is part a's drain, or part w's if wal, with the relay
// configured by mutate.
func drainWith(ctx context.Context, nc *nats.Conn, wal bool, mutate func(*relay.Config)) (result, error) {
	env, err := newRelayEnv(ctx, nc, nil)
	if err != nil {
		return result{}, err
	}
	defer env.close()
	rc := relayConfig()
	mutate(&rc)
	if wal {
		rc.Capture, rc.Slot = relay.CaptureWAL, env.db.Name
		if err := startAndStop(ctx, env, rc); err != nil {
			return result{}, err
		}
	}
	return env.drain(ctx, rc)
}

// drain is -rows pending rows in the environment's database, settled,
// then timed draining by a relay of rc.
func (e *relayEnv) drain(ctx context.Context, rc relay.Config) (result, error) {
	if err := fillOutbox(ctx, e.db.Pool, *rows); err != nil {
		return result{}, err
	}
	if err := benchkit.Settle(ctx, e.db.Pool); err != nil {
		return result{}, err
	}
	return timeDrain(ctx, e.options(rc))
}

// timeDrain starts a relay with opts and times it from its start until it
// published -rows rows; claimMs is its mean claim's time.
func timeDrain(ctx context.Context, opts relay.Options) (result, error) {
	obs := &counter{}
	opts.Observer = obs
	r, err := relay.New(opts)
	if err != nil {
		return result{}, err
	}
	stop := startTiming()
	if err := r.Start(ctx); err != nil {
		return result{}, err
	}
	for obs.n.Load() < int64(*rows) {
		time.Sleep(5 * time.Millisecond)
	}
	res := stop()
	_ = r.Stop(ctx)
	res.claimMs = float64(obs.claimNanos.Load()) / float64(obs.claims.Load()) / 1e6
	return res, nil
}

// startTiming starts timing -rows rows, and the CPU they use; the function
// it returns is their result until then.
func startTiming() func() result {
	cpu := startCPU()
	start := time.Now()
	return func() result {
		return result{n: *rows, rate: float64(*rows) / time.Since(start).Seconds(), cpu: cpu()}
	}
}

// benchNaive runs the seeds' publisher: every 2 s it reads up to 50 pending
// rows, publishes them one after another waiting for each PubAck, then marks
// them sent.
func benchNaive(ctx context.Context, nc *nats.Conn) (result, error) {
	db, err := pgtest.Create(ctx, *benchkit.AdminURL)
	if err != nil {
		return result{}, err
	}
	defer db.Close()
	sc, js, done, err := ensuredStream(ctx, nc)
	if err != nil {
		return result{}, err
	}
	defer done()
	if err := fillOutbox(ctx, db.Pool, 10_000); err != nil {
		return result{}, err
	}
	if err := benchkit.Settle(ctx, db.Pool); err != nil {
		return result{}, err
	}
	runCtx, cancel := context.WithTimeout(ctx, *naiveFor)
	defer cancel()
	published := 0
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for runCtx.Err() == nil {
		rs, err := db.Pool.Query(runCtx, `SELECT id, event_type, payload FROM outbox WHERE status = 'pending' ORDER BY id LIMIT 50`)
		if err != nil {
			break
		}
		type naiveRow struct {
			id      int64
			typ     string
			payload []byte
		}
		batch, err := pgx.CollectRows(rs, func(r pgx.CollectableRow) (naiveRow, error) {
			var n naiveRow
			return n, r.Scan(&n.id, &n.typ, &n.payload)
		})
		if err != nil {
			break
		}
		var ids []int64
		for _, r := range batch {
			if _, err := js.Publish(runCtx, sc.SubjectPrefix+"."+r.typ, r.payload, jetstream.WithMsgID(strconv.FormatInt(r.id, 10))); err != nil {
				break
			}
			ids = append(ids, r.id)
		}
		if _, err := db.Pool.Exec(runCtx, `UPDATE outbox SET status = 'sent', published_at = now() WHERE id = ANY($1)`, ids); err != nil {
			break
		}
		published += len(ids)
		select {
		case <-runCtx.Done():
		case <-tick.C:
		}
	}
	return result{n: published, rate: float64(published) / naiveFor.Seconds()}, nil
}

func benchRaw(ctx context.Context, nc *nats.Conn) (result, error) {
	return rawPublish(ctx, nc, func(sc stream.Config) func(i int) (*nats.Msg, error) {
		payloads := make([][]byte, 1000)
		for i := range payloads {
			payloads[i] = fmt.Appendf(nil, `{"version": %d, "product_id": %d, "price_cents": %d}`, i, i+1, 1000+i)
		}
		subject := sc.SubjectPrefix + ".product.updated"
		return func(i int) (*nats.Msg, error) {
			msg := nats.NewMsg(subject)
			msg.Data = payloads[i%len(payloads)]
			msg.Header.Set(wire.EventIDHeader, strconv.Itoa(i+1))
			msg.Header.Set(jetstream.MsgIDHeader, strconv.Itoa(i+1))
			return msg, nil
		}
	})
}

// benchRawRelayMessages is part m: part c's raw publishes of the messages
// the relay sends for part a's rows, built by wire.Encode (its headers:
// the event's identity, type, aggregate and number, creation time,
// origin, Nats-Msg-Id, Nats-Expected-Stream), without Postgres. What a
// relay of this contract could reach if reading and marking rows cost
// nothing: the ceiling its drains are judged against, beside part c.
func benchRawRelayMessages(ctx context.Context, nc *nats.Conn) (result, error) {
	build, err := relayMessages(nc)
	if err != nil {
		return result{}, err
	}
	return rawPublish(ctx, nc, build)
}

// relayMessages returns, for a stream, the relay's message for part a's
// i-th row (from 0): product.updated over 1000 products, of one database.
func relayMessages(nc *nats.Conn) (func(stream.Config) func(i int) (*nats.Msg, error), error) {
	db := outbox.Database{System: 7453120005312000531, Name: "bench"}
	ident, err := outbox.NewIdentity(db, []outbox.Epoch{{N: 1, FirstID: 1}})
	if err != nil {
		return nil, err
	}
	created := pgtype.Timestamptz{Time: time.Now(), Valid: true}
	return func(sc stream.Config) func(i int) (*nats.Msg, error) {
		return func(i int) (*nats.Msg, error) {
			g := i + 1
			product := g%1000 + 1
			rw := outboxstore.Claimed{ID: int64(g), AggregateType: "product", AggregateID: strconv.Itoa(product), EventType: "product.updated",
				Headers:      []byte(`{}`),
				Payload:      fmt.Appendf(nil, `{"version": %d, "product_id": %d, "price_cents": %d}`, g, product, 1000+g%90000),
				CreatedAt:    created,
				AggregateSeq: pgtype.Int8{Int64: int64(g/1000 + 1), Valid: true}}
			return wire.Encode(sc, ident, rw, nc.MaxPayload())
		}
	}, nil
}

// ensuredStream makes a fresh stream (freshStream) on the server, with a
// JetStream context made with opts; done deletes it.
func ensuredStream(ctx context.Context, nc *nats.Conn, opts ...jetstream.JetStreamOpt) (stream.Config, jetstream.JetStream, func(), error) {
	sc, done := freshStream(nc)
	js, err := jetstream.New(nc, opts...)
	if err == nil {
		err = stream.Ensure(ctx, js, sc, 0, quiet)
	}
	if err != nil {
		done()
		return sc, nil, nil, err
	}
	return sc, js, done, nil
}

// rawPublish publishes -rows messages, built by the function build returns
// for the fresh stream, asynchronously with max_in_flight in flight, and
// times them until the last PubAck.
func rawPublish(ctx context.Context, nc *nats.Conn, build func(stream.Config) func(i int) (*nats.Msg, error)) (result, error) {
	rc := relayConfig()
	// Failures are counted as they come, not kept as futures: 200,000
	// futures and their messages held to the end made the heap large
	// enough to keep the collector busy (under gctune's memory limit,
	// part m's publisher used twice the CPU a message).
	var failed atomic.Int64
	var firstErr atomic.Pointer[error]
	sc, js, done, err := ensuredStream(ctx, nc, jetstream.WithPublishAsyncMaxPending(rc.MaxInFlight),
		jetstream.WithPublishAsyncErrHandler(func(_ jetstream.JetStream, _ *nats.Msg, err error) {
			failed.Add(1)
			firstErr.CompareAndSwap(nil, &err)
		}))
	if err != nil {
		return result{}, err
	}
	defer done()
	next := build(sc)
	stop := startTiming()
	// A slow server (sync_interval always) keeps max_in_flight in flight
	// for long: wait for room rather than fail.
	if err := publishAll(js, *rows, next, jetstream.WithStallWait(time.Minute)); err != nil {
		return result{}, err
	}
	res := stop()
	if failed.Load() > 0 {
		return result{}, fmt.Errorf("%d raw publishes failed, the first: %v", failed.Load(), *firstErr.Load())
	}
	return res, nil
}

// publishAll publishes n messages, next's, asynchronously on js with
// opts, and waits up to 2 minutes for the last PubAck.
func publishAll(js jetstream.JetStream, n int, next func(i int) (*nats.Msg, error), opts ...jetstream.PublishOpt) error {
	for i := range n {
		msg, err := next(i)
		if err != nil {
			return err
		}
		if _, err := js.PublishMsgAsync(msg, opts...); err != nil {
			return err
		}
	}
	select {
	case <-js.PublishAsyncComplete():
		return nil
	case <-time.After(2 * time.Minute):
		return fmt.Errorf("raw publish: PubAcks missing after 2 minutes")
	}
}

// benchFastIngest is part f: part m's messages published as one
// fast-ingest batch (NATS 2.14's allow_batched, orbit's FastPublisher),
// which acknowledges a flow window instead of each message. It shows what
// the fewer acknowledgements save the publisher and the server (its CPU
// figures against m's); the relay does not use it: the acknowledgements
// it drops carry each event's stream sequence, its landing.
func benchFastIngest(ctx context.Context, nc *nats.Conn) (result, error) {
	build, err := relayMessages(nc)
	if err != nil {
		return result{}, err
	}
	sc, js, done, err := ensuredStream(ctx, nc)
	if err != nil {
		return result{}, err
	}
	defer done()
	next := build(sc)
	s, err := js.Stream(ctx, sc.Name)
	if err != nil {
		return result{}, err
	}
	cfg := s.CachedInfo().Config
	cfg.AllowBatchPublish = true
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		return result{}, fmt.Errorf("allow fast-ingest batches: %w", err)
	}
	var asyncErr atomic.Pointer[error]
	fp, err := jetstreamext.NewFastPublisher(js, jetstreamext.FastPublishFlowControl{Flow: 100, MaxOutstandingAcks: 4},
		jetstreamext.WithFastPublisherErrorHandler(func(err error) { asyncErr.CompareAndSwap(nil, &err) }))
	if err != nil {
		return result{}, err
	}
	stop := startTiming()
	for i := range *rows {
		msg, err := next(i)
		if err != nil {
			return result{}, err
		}
		if i == *rows-1 {
			_, err = fp.CommitMsg(ctx, msg)
		} else {
			_, err = fp.AddMsg(msg)
		}
		if err != nil {
			return result{}, fmt.Errorf("fast-ingest message %d: %w", i+1, err)
		}
	}
	res := stop()
	if e := asyncErr.Load(); e != nil {
		return result{}, fmt.Errorf("fast-ingest batch: %w", *e)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return result{}, err
	}
	if info.State.Msgs != uint64(*rows) {
		return result{}, fmt.Errorf("fast-ingest batch stored %d messages of %d", info.State.Msgs, *rows)
	}
	return res, nil
}

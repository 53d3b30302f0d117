package relay

import (
	"context"
	"errors"
	"log/slog"

	"github.com/fanout/fanout/stream"
	"github.com/nats-io/nats.go/jetstream"
)

// consumerGuard looks at every consumer of the stream, every
// stream.check_interval, for the marks of one turned against another
// role's (stream.HijackMarks: a delivery subject into the server's API or
// the stream's subjects; stream.PastTheEndWatch: a position past the
// stream's last message, at two checks in a row). A
// marked consumer is a difference in the relay's drift: logged with its
// setting, counted in fanout_relay_config_differences, and the relay is
// not ready until it is gone. The relay lists the consumers anyway (the
// audit's ack floors); the subscribers, which may not, check their own
// consumer the same way.
type consumerGuard struct {
	js            jetstream.JetStream
	streamName    string
	subjectPrefix string
	drift         *stream.Drift
	logger        *slog.Logger
	marked        map[string]bool // the consumers marked at the last check
	pastTheEnd    stream.PastTheEndWatch
}

func newConsumerGuard(js jetstream.JetStream, sc stream.Config, drift *stream.Drift, logger *slog.Logger) *consumerGuard {
	return &consumerGuard{js: js, streamName: sc.Name, subjectPrefix: sc.SubjectPrefix, drift: drift, logger: logger, marked: map[string]bool{}}
}

// check lists the consumers, then reads the stream's last sequence (after,
// so that a consumer keeping up is never past it). A check that gets no
// answer changes nothing. Called from one loop only.
func (g *consumerGuard) check(ctx context.Context) {
	s, err := g.js.Stream(ctx, g.streamName)
	if err != nil {
		return // the stream check says what is wrong with the stream
	}
	var infos []*jetstream.ConsumerInfo
	list := s.ListConsumers(ctx)
	for info := range list.Info() {
		infos = append(infos, info)
	}
	if err := list.Err(); err != nil {
		if !errors.Is(err, context.Canceled) {
			g.logger.Debug("consumer check: no answer", "stream", g.streamName, "error", err)
		}
		return
	}
	si, err := s.Info(ctx)
	if err != nil {
		g.logger.Debug("consumer check: no answer", "stream", g.streamName, "error", err)
		return
	}
	past := g.pastTheEnd.Round(infos, si.State.LastSeq)
	marked := map[string]bool{}
	for _, info := range infos {
		if ds := append(stream.HijackMarks(info, g.subjectPrefix), past[info.Name]...); len(ds) > 0 {
			marked[info.Name] = true
			g.drift.Set(g.object(info.Name), ds)
		}
	}
	for name := range g.marked {
		if !marked[name] {
			g.drift.Set(g.object(name), nil)
		}
	}
	g.marked = marked
}

func (g *consumerGuard) object(name string) string {
	return "consumer " + name + " of stream " + g.streamName
}

package metrics

// Where an event's time goes: one histogram per stage of its way, always
// on, and the same observations over the last minute for `fanout status`.

import (
	"errors"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The stages of an event's way, as the stage label of fanout_stage_seconds.
// The relay observes the first (its subscriber label is empty); every
// subscriber the next two; the search indexer the last.
const (
	// StagePublished: the writer's transaction (the outbox row's
	// created_at) to the PubAck.
	StagePublished = "commit_to_puback"
	// StageDelivered: the PubAck (the stream's timestamp of the message) to
	// the subscriber runtime taking it from its consumer.
	StageDelivered = "puback_to_delivered"
	// StageHandled: taken from the consumer to its effect and checkpoint
	// committed (waiting for a worker, the handler, the checkpoint).
	StageHandled = "delivered_to_handled"
	// StageSearchable: the search indexer's bulk write to the refresh
	// after which a search finds the document.
	StageSearchable = "handled_to_searchable"
)

// Stages lists the stages in the order an event passes them.
var Stages = []string{StagePublished, StageDelivered, StageHandled, StageSearchable}

// stageBuckets span 0.5 ms to 60 s in 36 steps of about 40 %, fine enough
// to tell 5 ms from 10 ms and 1.2 s from 1.5 s.
var stageBuckets = prometheus.ExponentialBucketsRange(0.0005, 60, 36)

// The window `fanout status` reports: the current slot and the six before
// it, so at least a full minute (60 to 70 s).
const (
	windowSlots = 7
	slotWidth   = 10 * time.Second
)

// StageWindow is one stage's observations over the last minute, as counts
// per histogram bucket: instances' windows add up (Merge) before a
// quantile is read.
type StageWindow struct {
	Stage      string `json:"stage"`
	Subscriber string `json:"subscriber,omitempty"`
	// Bounds are the buckets' upper bounds in seconds; Counts has one more
	// entry, for the observations above the last bound.
	Bounds []float64 `json:"bounds"`
	Counts []uint64  `json:"counts"`
}

// Count is how many observations the window holds.
func (w StageWindow) Count() uint64 {
	var n uint64
	for _, c := range w.Counts {
		n += c
	}
	return n
}

// Merge adds o's counts to w's (both must have the same bounds).
func (w *StageWindow) Merge(o StageWindow) error {
	if !slices.Equal(w.Bounds, o.Bounds) || len(o.Counts) != len(w.Counts) {
		return errors.New("stage windows with different buckets")
	}
	for i, c := range o.Counts {
		w.Counts[i] += c
	}
	return nil
}

// Quantile estimates the q-quantile (0 < q < 1) in seconds by linear
// interpolation within its bucket, as Prometheus's histogram_quantile does;
// NaN for an empty window. A quantile in the last, unbounded bucket is
// reported as the last bound.
func (w StageWindow) Quantile(q float64) float64 {
	total := w.Count()
	if total == 0 {
		return math.NaN()
	}
	rank := q * float64(total)
	var seen float64
	for i, c := range w.Counts {
		if seen+float64(c) < rank || c == 0 {
			seen += float64(c)
			continue
		}
		if i == len(w.Bounds) {
			return w.Bounds[len(w.Bounds)-1]
		}
		lower := 0.0
		if i > 0 {
			lower = w.Bounds[i-1]
		}
		return lower + (w.Bounds[i]-lower)*(rank-seen)/float64(c)
	}
	return w.Bounds[len(w.Bounds)-1]
}

// StageRecorder records stage durations into fanout_stage_seconds and a
// sliding window of the last minute (60 to 70 s). A process has one per registry (StagesOf): the
// relay's and each subscriber's observations share it.
type StageRecorder struct {
	hist *prometheus.HistogramVec
	now  func() time.Time

	mu      sync.Mutex
	windows map[stageKey]*window
}

type stageKey struct{ stage, subscriber string }

// window is a ring of windowSlots slots of slotWidth each.
type window struct {
	epochs [windowSlots]int64 // the slot's index of slotWidth since the Unix epoch
	counts [windowSlots][]uint64
}

var _ prometheus.Collector = (*StageRecorder)(nil)

// StagesOf returns reg's stage recorder, registering one on first use.
func StagesOf(reg prometheus.Registerer) *StageRecorder {
	s := newStageRecorder(time.Now)
	if err := reg.Register(s); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(*StageRecorder); ok {
				return existing
			}
		}
		panic(err)
	}
	return s
}

func newStageRecorder(now func() time.Time) *StageRecorder {
	return &StageRecorder{
		hist: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: "fanout", Name: "stage_seconds",
			Help:    "Time events spent in each stage of their way (stage: commit_to_puback, puback_to_delivered, delivered_to_handled, handled_to_searchable; subscriber empty for the relay's stage).",
			Buckets: stageBuckets}, []string{"stage", "subscriber"}),
		now:     now,
		windows: map[stageKey]*window{},
	}
}

func (s *StageRecorder) Describe(ch chan<- *prometheus.Desc) { s.hist.Describe(ch) }
func (s *StageRecorder) Collect(ch chan<- prometheus.Metric) { s.hist.Collect(ch) }

// Observe records durations spent in stage (by subscriber's events; empty
// for the relay). A negative duration (clocks a little apart) counts as 0.
func (s *StageRecorder) Observe(stage, subscriber string, took ...time.Duration) {
	if len(took) == 0 {
		return
	}
	h := s.hist.WithLabelValues(stage, subscriber)
	idx := make([]int, len(took))
	for i, d := range took {
		sec := max(d.Seconds(), 0)
		h.Observe(sec)
		idx[i], _ = slices.BinarySearch(stageBuckets, sec)
	}
	epoch := s.now().UnixNano() / int64(slotWidth)
	slot := int(epoch % windowSlots)
	s.mu.Lock()
	defer s.mu.Unlock()
	k := stageKey{stage, subscriber}
	w := s.windows[k]
	if w == nil {
		w = &window{}
		s.windows[k] = w
	}
	if w.epochs[slot] != epoch || w.counts[slot] == nil {
		w.epochs[slot] = epoch
		w.counts[slot] = make([]uint64, len(stageBuckets)+1)
	}
	for _, i := range idx {
		w.counts[slot][i]++
	}
}

// LastMinute returns each stage's observations over the last minute (the
// slots of the last windowSlots × slotWidth), stages in their order, then
// by subscriber.
func (s *StageRecorder) LastMinute() []StageWindow {
	epoch := s.now().UnixNano() / int64(slotWidth)
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]StageWindow, 0, len(s.windows))
	for k, w := range s.windows {
		sw := StageWindow{Stage: k.stage, Subscriber: k.subscriber, Bounds: stageBuckets, Counts: make([]uint64, len(stageBuckets)+1)}
		for i := range windowSlots {
			if w.counts[i] != nil && epoch-w.epochs[i] < windowSlots {
				for j, c := range w.counts[i] {
					sw.Counts[j] += c
				}
			}
		}
		if sw.Count() > 0 {
			out = append(out, sw)
		}
	}
	SortStageWindows(out)
	return out
}

// SortStageWindows orders windows by stage (in an event's order), then by
// subscriber.
func SortStageWindows(ws []StageWindow) {
	slices.SortFunc(ws, func(a, b StageWindow) int {
		if c := stageOrder(a.Stage) - stageOrder(b.Stage); c != 0 {
			return c
		}
		switch {
		case a.Subscriber < b.Subscriber:
			return -1
		case a.Subscriber > b.Subscriber:
			return 1
		}
		return 0
	})
}

func stageOrder(stage string) int {
	if i := slices.Index(Stages, stage); i >= 0 {
		return i
	}
	return len(Stages)
}

package operator

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/fanout/fanout/internal/metrics"
)

// StageLatency is one stage's latency over the last minute, merged over
// the roles that reported it.
type StageLatency struct {
	Stage      string  `json:"stage"`
	Subscriber string  `json:"subscriber,omitempty"`
	Events     uint64  `json:"events"`
	P50Ms      float64 `json:"p50_ms"`
	P99Ms      float64 `json:"p99_ms"`
}

// Stages are the stage latencies read from the roles' operations
// endpoints, and the endpoints that did not answer.
type Stages struct {
	From        []string       `json:"from"`
	Latencies   []StageLatency `json:"latencies"`
	Unreachable []string       `json:"unreachable,omitempty"`
}

// stagesTimeout bounds the read of one endpoint.
const stagesTimeout = 3 * time.Second

// ReadStages reads /stages from each operations endpoint (host:port),
// adds up the windows of each stage and subscriber across them (instances
// of one subscriber add up), and reports p50 and p99. An endpoint that does
// not answer is named in Unreachable, not an error: the others still count.
func ReadStages(ctx context.Context, endpoints []string) Stages {
	out := Stages{From: endpoints}
	type key struct{ stage, subscriber string }
	merged := map[key]*metrics.StageWindow{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, ep := range endpoints {
		wg.Go(func() {
			ws, err := readStages(ctx, ep)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				out.Unreachable = append(out.Unreachable, fmt.Sprintf("%s: %v", ep, err))
				return
			}
			for _, w := range ws {
				k := key{w.Stage, w.Subscriber}
				if m := merged[k]; m == nil {
					merged[k] = &w
				} else if err := m.Merge(w); err != nil {
					out.Unreachable = append(out.Unreachable, fmt.Sprintf("%s: %v", ep, err))
				}
			}
		})
	}
	wg.Wait()
	ws := make([]metrics.StageWindow, 0, len(merged))
	for _, w := range merged {
		ws = append(ws, *w)
	}
	metrics.SortStageWindows(ws)
	for _, w := range ws {
		out.Latencies = append(out.Latencies, StageLatency{Stage: w.Stage, Subscriber: w.Subscriber, Events: w.Count(),
			P50Ms: w.Quantile(0.5) * 1000, P99Ms: w.Quantile(0.99) * 1000})
	}
	return out
}

func readStages(ctx context.Context, endpoint string) ([]metrics.StageWindow, error) {
	ctx, cancel := context.WithTimeout(ctx, stagesTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+endpoint+"/stages", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET /stages: %s", resp.Status)
	}
	var ws []metrics.StageWindow
	if err := json.NewDecoder(resp.Body).Decode(&ws); err != nil {
		return nil, fmt.Errorf("GET /stages: %w", err)
	}
	return ws, nil
}

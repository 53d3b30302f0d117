package search_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
)

// troubled stands between a client and the real engine and behaves as an
// engine in trouble: the answers to the first `lost` requests never arrive
// (the engine did the work), the next `busy` requests get 503 without
// reaching it. Then it lets everything through.
type troubled struct {
	next       http.RoundTripper
	mu         sync.Mutex
	lost, busy int
}

func (tr *troubled) RoundTrip(req *http.Request) (*http.Response, error) {
	tr.mu.Lock()
	lose, busy := tr.lost > 0, tr.lost == 0 && tr.busy > 0
	if lose {
		tr.lost--
	} else if busy {
		tr.busy--
	}
	tr.mu.Unlock()
	if busy {
		return &http.Response{StatusCode: http.StatusServiceUnavailable, Header: http.Header{"Content-Type": {"application/json"}},
			Body: io.NopCloser(strings.NewReader(`{"error":"overloaded","status":503}`)), Request: req}, nil
	}
	res, err := tr.next.RoundTrip(req)
	if err != nil || !lose {
		return res, err
	}
	_ = res.Body.Close()
	return nil, errors.New("connection reset by peer (the answer was lost)")
}

func (tr *troubled) CloseIdleConnections() {
	if c, ok := tr.next.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func (tr *troubled) trouble(lost, busy int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.lost, tr.busy = lost, busy
}

// troubledClient is a client of the real engine through a troubled
// transport; patient clients wait out outages and count them.
func troubledClient(t *testing.T, patient bool) (*search.Client, *troubled, func() int) {
	t.Helper()
	searchtest.Client(t, search.OpenSearch) // the engine answers
	tr := &troubled{next: http.DefaultTransport.(*http.Transport).Clone()}
	cfg := searchtest.Config(search.OpenSearch)
	cfg.Transport, cfg.Timeout = tr, 10*time.Second
	var mu sync.Mutex
	outages := 0
	if patient {
		cfg.OnOutage = func(error, time.Duration) { mu.Lock(); outages++; mu.Unlock() }
	}
	c, err := search.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c, tr, func() int { mu.Lock(); defer mu.Unlock(); return outages }
}

// A client told to wait out outages gets every request through an engine
// whose answers are lost or that is overloaded: the creation and deletion
// whose answer was lost count as done when the retry finds them done. The
// same trouble fails a client that was not told to wait.
func TestAPatientClientWaitsOutAnEngineInTrouble(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	index := fmt.Sprintf("t%08x-patience", rand.Uint32())
	c, tr, outages := troubledClient(t, true)
	t.Cleanup(func() { _ = searchtest.Client(t, search.OpenSearch).DeleteIndex(context.Background(), index) })

	steps := []struct {
		name string
		call func() error
	}{
		{"create", func() error { return c.CreateIndex(ctx, index, []byte(`{}`)) }},
		{"refresh", func() error { return c.Refresh(ctx, index) }},
		{"delete", func() error { return c.DeleteIndex(ctx, index) }},
	}
	for _, s := range steps {
		before := outages()
		tr.trouble(1, 4) // more 503s than the vendor client retries itself
		if err := s.call(); err != nil {
			t.Fatalf("%s through the trouble: %v", s.name, err)
		}
		if outages() == before {
			t.Errorf("%s: no outage reported", s.name)
		}
	}
	if names, err := c.Indices(ctx, index); err != nil || len(names) != 0 {
		t.Fatalf("after the delete: indices %v, %v; want none", names, err)
	}

	impatient, tr2, _ := troubledClient(t, false)
	tr2.trouble(1, 0)
	if err := impatient.CreateIndex(ctx, index, []byte(`{}`)); err == nil {
		t.Fatal("a client not told to wait got through a lost answer: the trouble above proves nothing")
	}
	_ = c.DeleteIndex(ctx, index)
}

// A refusal is an answer, not an outage: it comes back at once. An outage
// longer than the caller's context ends with the context's error and the
// engine's last failure.
func TestAPatientClientReturnsRefusalsAndGivesUpWithItsContext(t *testing.T) {
	c, tr, outages := troubledClient(t, true)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := c.CreateIndex(ctx, "Not-Lowercase", []byte(`{}`))
	var refusal *search.Error
	if !errors.As(err, &refusal) || refusal.Status != http.StatusBadRequest || outages() != 0 {
		t.Fatalf("an invalid index name: %v after %d outages; want the engine's 400 at once", err, outages())
	}

	tr.trouble(0, 1<<30)
	short, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err = c.Refresh(short, "any")
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "overloaded") || outages() == 0 {
		t.Fatalf("an endless outage: %v after %d outages; want the deadline and the engine's last failure", err, outages())
	}
}

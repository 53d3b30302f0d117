// Package searchtest connects tests to the real search engine that
// deploy/services.sh starts (OpenSearch, at FANOUT_TEST_SEARCH_URL, default
// http://127.0.0.1:9200), through either implementation, and gives each test
// an alias of its own.
package searchtest

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/fanout/fanout/search"
)

// Engines are the implementations tests run over.
var Engines = []string{search.Elasticsearch, search.OpenSearch}

// URL is the engine the tests use.
func URL() string {
	if u := os.Getenv("FANOUT_TEST_SEARCH_URL"); u != "" {
		return u
	}
	return "http://127.0.0.1:9200"
}

// elasticProduct makes an OpenSearch answer pass the Elasticsearch
// implementation's product check, which insists on this header. Tests only: in
// production the Elasticsearch implementation talks to Elasticsearch.
type elasticProduct struct{ next http.RoundTripper }

// CloseIdleConnections lets the client close the wrapped transport's.
func (e elasticProduct) CloseIdleConnections() {
	if t, ok := e.next.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
}

func (e elasticProduct) RoundTrip(req *http.Request) (*http.Response, error) {
	res, err := e.next.RoundTrip(req)
	if err == nil {
		res.Header.Set("X-Elastic-Product", "Elasticsearch")
	}
	return res, err
}

// Config returns the client configuration for engine against the test
// engine (with the header shim for the Elasticsearch implementation).
func Config(engine string) search.Config {
	cfg := search.Config{Engine: engine, Addresses: []string{URL()}, Timeout: 30 * time.Second}
	if engine == search.Elasticsearch {
		cfg.Transport = elasticProduct{next: http.DefaultTransport.(*http.Transport).Clone()}
	}
	return cfg
}

// Client returns a client of engine's implementation; the test fails if the
// engine does not answer.
func Client(t testing.TB, engine string) *search.Client {
	t.Helper()
	c, err := search.New(Config(engine))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Info(ctx); err != nil {
		t.Fatalf("searchtest: no search engine at %s (start it with deploy/services.sh up): %v", URL(), err)
	}
	return c
}

// Alias returns an alias name of the test's own; the indices behind it
// (<alias>-v*) are deleted when the test ends.
func Alias(t testing.TB, c *search.Client) string {
	t.Helper()
	alias := fmt.Sprintf("t%08x-products", rand.Uint32())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		names, _ := c.Indices(ctx, alias+"-v*")
		for _, n := range names {
			_ = c.DeleteIndex(ctx, n)
		}
	})
	return alias
}

// Put writes a document straight into index under an external version of
// the given type (external, external_gte), behind fanout's back: the drift
// a test plants for a check or a repair to find. The write is refreshed.
func Put(t testing.TB, index, id string, version int64, versionType string, doc any) {
	t.Helper()
	body, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	path := fmt.Sprintf("/%s/_doc/%s?version=%d&version_type=%s&refresh=true", url.PathEscape(index), url.PathEscape(id), version, url.QueryEscape(versionType))
	if err := call(http.MethodPut, path, body, nil); err != nil {
		t.Fatalf("searchtest: put document %s into %s: %v", id, index, err)
	}
}

package search_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/search/searchtest"
)

// The Elasticsearch implementation refuses a server that is not
// Elasticsearch: pointed at the real OpenSearch (which sends no
// X-Elastic-Product header), its first request fails and names the
// setting, and so does every one after it. Through the test shim that adds
// the header, the same server is accepted.
func TestElasticsearchRefusesAnotherProduct(t *testing.T) {
	searchtest.Client(t, search.OpenSearch) // the engine answers
	c, err := search.New(search.Config{Engine: search.Elasticsearch, Addresses: []string{searchtest.URL()}, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 2 {
		_, err := c.Info(ctx)
		if err == nil || !strings.Contains(err.Error(), "not Elasticsearch") || !strings.Contains(err.Error(), "search.engine") {
			t.Fatalf("request %d: want the product check's refusal, got %v", i+1, err)
		}
	}
	if _, err := c.Indices(ctx, "*"); err == nil {
		t.Fatal("a later request passed the failed product check")
	}

	shimmed := searchtest.Client(t, search.Elasticsearch)
	if info, err := shimmed.Info(ctx); err != nil || info.Distribution != search.OpenSearch {
		t.Fatalf("through the header shim: %+v, %v", info, err)
	}
}

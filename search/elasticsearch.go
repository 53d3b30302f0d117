package search

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"

	"github.com/elastic/elastic-transport-go/v8/elastictransport"
)

// elasticsearchClient sends requests to Elasticsearch through
// elastictransport, the transport the go-elasticsearch client is built on:
// the same node pool, retries, authentication and TLS. The client package
// itself (github.com/elastic/go-elasticsearch/v8) also compiles its typed
// API, 860 packages none of which fanout calls, which doubled the time to
// build fanout on a fresh machine (90 s of 150 s on 2 cores) and weighed on
// every test build. What it adds to the transport for the requests fanout
// sends is its product check, kept here.
type elasticsearchClient struct {
	*elastictransport.Client

	mu      sync.Mutex
	checked bool  // the product check has seen a successful answer
	err     error // its verdict
}

func newElasticsearchClient(cfg Config, transport http.RoundTripper) (*elasticsearchClient, error) {
	urls := make([]*url.URL, 0, len(cfg.Addresses))
	for _, a := range cfg.Addresses {
		u, err := url.Parse(a)
		if err != nil {
			return nil, fmt.Errorf("search.addresses: %q: %w", a, err)
		}
		urls = append(urls, u)
	}
	if len(urls) == 0 {
		return nil, errors.New("search.addresses: none")
	}
	opts := []elastictransport.Option{
		elastictransport.WithURLs(urls...),
		elastictransport.WithTransport(transport),
		elastictransport.WithRetry(2, 502, 503, 504),
	}
	if cfg.Username != "" || cfg.Password != "" {
		opts = append(opts, elastictransport.WithBasicAuth(cfg.Username, cfg.Password))
	}
	t, err := elastictransport.NewClient(opts...)
	if err != nil {
		return nil, err
	}
	return &elasticsearchClient{Client: t}, nil
}

// errNotElasticsearch is the product check's refusal.
var errNotElasticsearch = errors.New(`the server is not Elasticsearch: its answer has no "X-Elastic-Product: Elasticsearch" header (for OpenSearch set search.engine: opensearch)`)

// Perform sends req, refusing a server that is not Elasticsearch: the first
// successful answer must carry the product header, as go-elasticsearch's
// client requires, so a misconfigured engine fails at start instead of
// indexing into something that only looks like Elasticsearch.
func (c *elasticsearchClient) Perform(req *http.Request) (*http.Response, error) {
	res, err := c.Client.Perform(req)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if !c.checked && res.StatusCode >= 200 && res.StatusCode < 300 {
		c.checked = true
		if res.Header.Get("X-Elastic-Product") != "Elasticsearch" {
			c.err = errNotElasticsearch
		}
	}
	err = c.err
	c.mu.Unlock()
	if err != nil {
		res.Body.Close()
		return nil, err
	}
	return res, nil
}

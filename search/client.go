package search

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/opensearch-project/opensearch-go/v4"
)

// Engines.
const (
	Elasticsearch = "elasticsearch"
	OpenSearch    = "opensearch"
)

// Config is how to reach the engine.
type Config struct {
	Engine             string   // Elasticsearch or OpenSearch
	Addresses          []string // e.g. http://127.0.0.1:9200
	Username, Password string
	CAFile             string
	InsecureSkipVerify bool
	Timeout            time.Duration // bounds each request
	// OnOutage, when set, makes every request wait out an engine that is
	// down, overloaded or too slow to answer within Timeout: the request
	// is sent again with backoff until it gets an answer or its context
	// ends, and OnOutage hears each failure and the wait before the next
	// try. Commands that work for minutes (a reindex, a repair) set it;
	// the live indexer does not (its runtime stops taking events instead).
	OnOutage func(err error, wait time.Duration)
	// Transport replaces the HTTP transport (tests only).
	Transport http.RoundTripper
}

// performer is what both vendor clients offer.
type performer interface {
	Perform(*http.Request) (*http.Response, error)
}

// Close stops the vendor client's background work (OpenSearch's client
// polls node stats and cluster health) and closes idle connections.
func (c *Client) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var err error
	switch v := c.p.(type) {
	case *opensearch.Client:
		err = v.Close()
	case *elasticsearchClient:
		err = v.Close(ctx)
	}
	if t, ok := c.transport.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
	return err
}

// Client talks to the engine.
type Client struct {
	p         performer
	timeout   time.Duration
	transport http.RoundTripper
	onOutage  func(err error, wait time.Duration)
}

// New returns a client for cfg.Engine.
func New(cfg Config) (*Client, error) {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	transport := cfg.Transport
	if transport == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = 32
		if cfg.CAFile != "" || cfg.InsecureSkipVerify {
			tc := &tls.Config{InsecureSkipVerify: cfg.InsecureSkipVerify} //nolint:gosec // an explicit setting for test clusters
			if cfg.CAFile != "" {
				pem, err := os.ReadFile(cfg.CAFile)
				if err != nil {
					return nil, fmt.Errorf("search.ca_file: %w", err)
				}
				tc.RootCAs = x509.NewCertPool()
				if !tc.RootCAs.AppendCertsFromPEM(pem) {
					return nil, fmt.Errorf("search.ca_file: no certificate in %s", cfg.CAFile)
				}
			}
			t.TLSClientConfig = tc
		}
		transport = t
	}
	c := &Client{timeout: cfg.Timeout, transport: transport, onOutage: cfg.OnOutage}
	switch cfg.Engine {
	case Elasticsearch:
		es, err := newElasticsearchClient(cfg, transport)
		if err != nil {
			return nil, fmt.Errorf("elasticsearch client: %w", err)
		}
		c.p = es
	case OpenSearch:
		osc, err := opensearch.NewClient(opensearch.Config{
			Addresses: cfg.Addresses, Username: cfg.Username, Password: cfg.Password,
			Transport: transport, MaxRetries: 2, RetryOnStatus: []int{502, 503, 504},
		})
		if err != nil {
			return nil, fmt.Errorf("opensearch client: %w", err)
		}
		c.p = osc
	default:
		return nil, fmt.Errorf("search.engine must be %s or %s (got %q)", Elasticsearch, OpenSearch, cfg.Engine)
	}
	return c, nil
}

// Error is an error response from the engine.
type Error struct {
	Status int
	Type   string
	Reason string
}

func (e *Error) Error() string {
	return fmt.Sprintf("search engine: %d %s: %s", e.Status, e.Type, e.Reason)
}

// IsNotFound reports whether err is a 404 from the engine.
func IsNotFound(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Status == http.StatusNotFound
}

// do sends one request and decodes a JSON answer into out (if not nil),
// waiting out an outage if the client was configured to (patience.go).
func (c *Client) do(ctx context.Context, method, path string, body []byte, contentType string, out any) error {
	if c.onOutage == nil {
		return c.once(ctx, method, path, body, contentType, out)
	}
	return c.patiently(ctx, method, path, body, contentType, out)
}

// once sends one request, bounded by the client's timeout.
func (c *Client) once(ctx context.Context, method, path string, body []byte, contentType string, out any) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, path, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", contentType)
	}
	res, err := c.p.Perform(req)
	if err != nil {
		return fmt.Errorf("search engine %s %s: %w", method, path, err)
	}
	defer res.Body.Close()
	data, err := io.ReadAll(res.Body)
	if err != nil {
		return fmt.Errorf("search engine %s %s: read response: %w", method, path, err)
	}
	if res.StatusCode >= 300 {
		e := &Error{Status: res.StatusCode}
		var env struct {
			Error json.RawMessage `json:"error"`
		}
		if json.Unmarshal(data, &env) == nil && len(env.Error) > 0 {
			var detail struct {
				Type   string `json:"type"`
				Reason string `json:"reason"`
			}
			if json.Unmarshal(env.Error, &detail) == nil && detail.Type != "" {
				e.Type, e.Reason = detail.Type, detail.Reason
			} else {
				e.Reason = strings.Trim(string(env.Error), `"`)
			}
		} else {
			e.Reason = truncate(string(data), 500)
		}
		return e
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return fmt.Errorf("search engine %s %s: decode response: %w", method, path, err)
		}
	}
	return nil
}

func (c *Client) json(ctx context.Context, method, path string, in, out any) error {
	var body []byte
	if in != nil {
		var err error
		if raw, ok := in.([]byte); ok {
			body = raw
		} else if body, err = json.Marshal(in); err != nil {
			return err
		}
	}
	return c.do(ctx, method, path, body, "application/json", out)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

func esc(s string) string { return url.PathEscape(s) }

// Info is the engine's identity.
type Info struct {
	Distribution string
	Version      string
}

// Info asks the engine who it is; it is also the readiness probe.
func (c *Client) Info(ctx context.Context) (Info, error) {
	var out struct {
		Version struct {
			Number       string `json:"number"`
			Distribution string `json:"distribution"`
		} `json:"version"`
	}
	if err := c.json(ctx, http.MethodGet, "/", nil, &out); err != nil {
		return Info{}, err
	}
	d := out.Version.Distribution
	if d == "" {
		d = Elasticsearch
	}
	return Info{Distribution: d, Version: out.Version.Number}, nil
}

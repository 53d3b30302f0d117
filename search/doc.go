// Package search is fanout's client of the search engine: the few index,
// alias, bulk and search operations the search indexer and `fanout reindex`
// need, over either engine.
//
// Two implementations sit behind Client, chosen by search.engine:
// Elasticsearch through elastictransport, the transport of
// github.com/elastic/go-elasticsearch/v8 (the default; see elasticsearch.go
// for why not its client package), and OpenSearch through
// github.com/opensearch-project/opensearch-go/v4.
// Both speak the same REST API for these operations, so Client builds the
// requests once and sends them through the chosen vendor client, which
// brings its own transport, retries, authentication, TLS and, for
// Elasticsearch, go-elasticsearch's product check: the client refuses a
// server that does not answer with "X-Elastic-Product: Elasticsearch".
// OpenSearch does not send that header, so pointing the Elasticsearch
// implementation at OpenSearch fails at the first request; only tests wrap
// the transport to add it (see searchtest), never production code.
package search

package searchindex

import (
	"net/url"
	"strings"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/validate"
	"github.com/fanout/fanout/search"
)

// Config is the search engine and the product index the indexer and the
// reindex work with (the search.* keys). DefaultConfig holds the defaults;
// Validate names every key that is wrong.
type Config struct {
	// Engine is elasticsearch or opensearch. Default elasticsearch.
	Engine string `koanf:"engine"`
	// URL is one or more comma-separated node URLs. Default DefaultURL.
	URL string `koanf:"url"`
	// Username and Password authenticate with HTTP basic auth. Secret.
	Username     string `koanf:"username"`
	Password     string `koanf:"password"`
	PasswordFile string `koanf:"password_file"`
	// CAFile is a PEM file of CAs to trust for https. Default empty (system roots).
	CAFile string `koanf:"ca_file"`
	// InsecureSkipVerify disables certificate checks (test clusters only). Default false.
	InsecureSkipVerify bool `koanf:"insecure_skip_verify"`
	// Timeout bounds each request. Default 10s, > 0.
	Timeout time.Duration `koanf:"timeout"`
	// Alias is the name searches and the indexer use; it points at
	// <alias>-v<N>. Default "products".
	Alias string `koanf:"alias"`
	// Provision is auto (create the first index and the alias if missing),
	// verify (refuse to start without them) or off. Default auto.
	Provision string `koanf:"provision"`
	// BulkSize is the most operations in one bulk request. Default 1000, 1..10000.
	BulkSize int `koanf:"bulk_size"`
	// RefreshAfter is how soon after a write the indexer refreshes the index
	// (one refresh for every write made meanwhile), so a change is
	// searchable within about this long instead of waiting for the index's
	// refresh_interval; it also measures write → searchable
	// (fanout_stage_seconds, stage handled_to_searchable). 0 leaves
	// visibility to refresh_interval, unmeasured. Default 200ms, 0..1m.
	RefreshAfter time.Duration `koanf:"refresh_after"`
	// ReindexMaxFailures is how many documents may fail in a reindex before
	// it aborts without swapping the alias. Default 0, >= 0.
	ReindexMaxFailures int `koanf:"reindex_max_failures"`
}

// DefaultURL is the search engine of a development machine.
const DefaultURL = "http://127.0.0.1:9200"

// DefaultConfig returns the search settings' defaults.
func DefaultConfig() Config {
	return Config{Engine: search.Elasticsearch, URL: DefaultURL, Timeout: 10 * time.Second, Alias: "products",
		Provision: "auto", BulkSize: 1000, RefreshAfter: 200 * time.Millisecond}
}

// Validate checks the search.* keys, naming every key that is wrong.
func (c Config) Validate() error {
	var v validate.Errors
	v.OneOf("search.engine", c.Engine, search.Elasticsearch, search.OpenSearch)
	for _, raw := range strings.Split(c.URL, ",") {
		if u, err := url.Parse(strings.TrimSpace(raw)); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			v.Bad("search.url", "must be a comma-separated list of http:// or https:// URLs (got %q)", config.RedactURL(raw))
		}
	}
	v.Positive("search.timeout", c.Timeout)
	if c.Alias == "" || strings.ToLower(c.Alias) != c.Alias || strings.ContainsAny(c.Alias, ` ,"*\/<>|?#`) {
		v.Bad("search.alias", "must be a lowercase index name without spaces or , \" * \\ / < > | ? # (got %q)", c.Alias)
	}
	v.OneOf("search.provision", c.Provision, "auto", "verify", "off")
	v.Between("search.bulk_size", int64(c.BulkSize), 1, 10000)
	if c.RefreshAfter < 0 || c.RefreshAfter > time.Minute {
		v.Bad("search.refresh_after", "must be between 0 (off) and 1m (got %s)", c.RefreshAfter)
	}
	if c.ReindexMaxFailures < 0 {
		v.Bad("search.reindex_max_failures", "must be 0 or more (got %d)", c.ReindexMaxFailures)
	}
	return v.Err()
}

// Client is the search client's configuration for these settings.
func (c Config) Client() search.Config {
	var addrs []string
	for _, a := range strings.Split(c.URL, ",") {
		addrs = append(addrs, strings.TrimSpace(a))
	}
	return search.Config{
		Engine: c.Engine, Addresses: addrs, Username: c.Username, Password: c.Password,
		CAFile: c.CAFile, InsecureSkipVerify: c.InsecureSkipVerify, Timeout: c.Timeout,
	}
}

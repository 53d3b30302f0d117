package search

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
)

// CreateIndex creates an index from a settings-and-mappings body.
func (c *Client) CreateIndex(ctx context.Context, name string, body []byte) error {
	return c.json(ctx, http.MethodPut, "/"+esc(name), body, nil)
}

// DeleteIndex deletes an index.
func (c *Client) DeleteIndex(ctx context.Context, name string) error {
	return c.json(ctx, http.MethodDelete, "/"+esc(name), nil, nil)
}

// Indices lists the indices whose names match pattern (e.g. "products-v*").
func (c *Client) Indices(ctx context.Context, pattern string) ([]string, error) {
	var out []struct {
		Index string `json:"index"`
	}
	err := c.json(ctx, http.MethodGet, "/_cat/indices/"+esc(pattern)+"?format=json&h=index&expand_wildcards=all", nil, &out)
	names := make([]string, 0, len(out))
	for _, o := range out {
		names = append(names, o.Index)
	}
	return sorted(names, err)
}

// AliasIndices returns the indices alias points to (none if it does not
// exist).
func (c *Client) AliasIndices(ctx context.Context, alias string) ([]string, error) {
	var out map[string]json.RawMessage
	err := c.json(ctx, http.MethodGet, "/_alias/"+esc(alias), nil, &out)
	return sorted(slices.Collect(maps.Keys(out)), err)
}

// sorted is a listing's answer: the names in order, or none when the engine
// has nothing of that name (404).
func sorted(names []string, err error) ([]string, error) {
	if IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	slices.Sort(names)
	return names, nil
}

// SwapAlias points alias at index, and away from every other index, in one
// atomic _aliases call: searches through the alias never see no index or
// two.
func (c *Client) SwapAlias(ctx context.Context, alias, index string) error {
	current, err := c.AliasIndices(ctx, alias)
	if err != nil {
		return err
	}
	type action map[string]map[string]any
	var actions []action
	for _, old := range current {
		if old != index {
			actions = append(actions, action{"remove": {"index": old, "alias": alias}})
		}
	}
	actions = append(actions, action{"add": {"index": index, "alias": alias, "is_write_index": true}})
	return c.json(ctx, http.MethodPost, "/_aliases", map[string]any{"actions": actions}, nil)
}

// SetRefreshInterval sets index.refresh_interval ("-1" disables refresh).
func (c *Client) SetRefreshInterval(ctx context.Context, index, interval string) error {
	body := map[string]any{"index": map[string]any{"refresh_interval": interval}}
	return c.json(ctx, http.MethodPut, "/"+esc(index)+"/_settings", body, nil)
}

// Refresh makes everything indexed so far searchable.
func (c *Client) Refresh(ctx context.Context, index string) error {
	return c.json(ctx, http.MethodPost, "/"+esc(index)+"/_refresh", nil, nil)
}

// Count returns the number of documents in an index or alias.
func (c *Client) Count(ctx context.Context, index string) (int64, error) {
	var out struct {
		Count int64 `json:"count"`
	}
	if err := c.json(ctx, http.MethodGet, "/"+esc(index)+"/_count", nil, &out); err != nil {
		return 0, err
	}
	return out.Count, nil
}

// Doc is a stored document, as the engine's answers name its fields.
type Doc struct {
	ID      string          `json:"_id"`
	Version int64           `json:"_version"`
	Source  json.RawMessage `json:"_source"`
}

// MGet fetches documents by id; missing ones are absent from the map.
func (c *Client) MGet(ctx context.Context, index string, ids []string) (map[string]Doc, error) {
	var out struct {
		Docs []struct {
			Doc
			Found bool `json:"found"`
		} `json:"docs"`
	}
	if err := c.json(ctx, http.MethodPost, "/"+esc(index)+"/_mget", map[string]any{"ids": ids}, &out); err != nil {
		return nil, err
	}
	docs := make(map[string]Doc, len(out.Docs))
	for _, d := range out.Docs {
		if d.Found {
			docs[d.ID] = d.Doc
		}
	}
	return docs, nil
}

// SearchResult is one page of hits.
type SearchResult struct {
	Total int64
	Hits  []Doc
	sort  []json.RawMessage
}

// Search runs a query body against an index or alias.
func (c *Client) Search(ctx context.Context, index string, query any) (SearchResult, error) {
	var out struct {
		Hits struct {
			Total struct {
				Value int64 `json:"value"`
			} `json:"total"`
			Hits []struct {
				Doc
				Sort []json.RawMessage `json:"sort"`
			} `json:"hits"`
		} `json:"hits"`
	}
	if err := c.json(ctx, http.MethodPost, "/"+esc(index)+"/_search", query, &out); err != nil {
		return SearchResult{}, err
	}
	r := SearchResult{Total: out.Hits.Total.Value}
	for _, h := range out.Hits.Hits {
		r.Hits = append(r.Hits, h.Doc)
		r.sort = h.Sort
	}
	return r, nil
}

// Scan calls fn for every document of an index, in ascending order of the
// numeric field idField, a page at a time (search_after: no scroll context
// to leak, bounded memory).
func (c *Client) Scan(ctx context.Context, index, idField string, fn func(Doc) error) error {
	var after []json.RawMessage
	for {
		q := map[string]any{
			"size":             1000,
			"version":          true,
			"sort":             []any{map[string]any{idField: "asc"}},
			"track_total_hits": false,
		}
		if after != nil {
			q["search_after"] = after
		}
		page, err := c.Search(ctx, index, q)
		if err != nil {
			return fmt.Errorf("scan %s: %w", index, err)
		}
		for _, d := range page.Hits {
			if err := fn(d); err != nil {
				return err
			}
		}
		if len(page.Hits) < 1000 {
			return nil
		}
		after = page.sort
	}
}

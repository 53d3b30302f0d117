package search

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
)

// Op is one bulk operation.
type Op struct {
	ID     string
	Delete bool
	// Version, if not zero, is an external version: the engine applies the
	// operation only if it is newer than what it has (or had, for a delete
	// it still remembers), and answers 409 otherwise.
	Version int64
	Doc     json.RawMessage // for an index operation
}

// Result is one bulk item's outcome.
type Result struct {
	ID     string
	Status int
	Type   string // error type, e.g. mapper_parsing_exception
	Reason string
}

// OK reports success: stored, deleted, already deleted (404 on a delete),
// or a conflict with a newer version (the engine has something newer).
func (r Result) OK() bool {
	return r.Status < 300 || r.Status == http.StatusConflict || r.Status == http.StatusNotFound
}

// Retryable reports a failure that may pass later: the engine is
// overloaded (429) or in trouble (5xx).
func (r Result) Retryable() bool {
	return r.Status == http.StatusTooManyRequests || r.Status >= 500
}

// Bulk sends ops to index (an index or an alias with a write index) in one
// _bulk request and returns each item's outcome, in order. A 200 answer
// with "errors": true is a partial failure: every item is read.
func (c *Client) Bulk(ctx context.Context, index string, ops []Op) ([]Result, error) {
	if len(ops) == 0 {
		return nil, nil
	}
	var body bytes.Buffer
	enc := json.NewEncoder(&body)
	for _, op := range ops {
		meta := map[string]any{"_id": op.ID}
		if op.Version > 0 {
			meta["version"] = op.Version
			meta["version_type"] = "external"
		}
		action := "index"
		if op.Delete {
			action = "delete"
		}
		if err := enc.Encode(map[string]any{action: meta}); err != nil {
			return nil, err
		}
		if !op.Delete {
			body.Write(op.Doc)
			body.WriteByte('\n')
		}
	}
	var out struct {
		Errors bool `json:"errors"`
		Items  []map[string]struct {
			ID     string `json:"_id"`
			Status int    `json:"status"`
			Error  *struct {
				Type   string `json:"type"`
				Reason string `json:"reason"`
			} `json:"error"`
		} `json:"items"`
	}
	if err := c.do(ctx, http.MethodPost, "/"+esc(index)+"/_bulk", body.Bytes(), "application/x-ndjson", &out); err != nil {
		return nil, err
	}
	if len(out.Items) != len(ops) {
		return nil, fmt.Errorf("bulk: %d items answered for %d operations", len(out.Items), len(ops))
	}
	results := make([]Result, len(ops))
	for i, item := range out.Items {
		for _, it := range item { // one key: the action
			r := Result{ID: it.ID, Status: it.Status}
			if it.Error != nil {
				r.Type, r.Reason = it.Error.Type, it.Error.Reason
			}
			if r.ID == "" {
				r.ID = ops[i].ID
			}
			results[i] = r
		}
	}
	return results, nil
}

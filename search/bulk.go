package search

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
)

// Version types of an operation with a Version.
const (
	// External applies the operation only if its version is above the
	// stored one (or the remembered deletion's): the normal path, where a
	// 409 means the engine already has this state or a newer one, so
	// racing writers converge on the newest state whatever order they
	// arrive in.
	External = "external"
	// ExternalGTE also applies it over the same version. Only a repair
	// wants that: a document that differs from SQL at the version SQL has
	// (written behind fanout's back, or by a change that did not bump the
	// version) is a 409 under External and stays wrong for good. Nothing
	// else may use it: it lets a write replace a state with another of the
	// same version, and the newest-wins argument assumes one state per
	// version.
	ExternalGTE = "external_gte"
)

// Op is one bulk operation.
type Op struct {
	ID     string
	Delete bool
	// Version, if not zero, is an external version: the engine applies the
	// operation only if it is newer than what it has (or had, for a delete
	// it still remembers), and answers 409 otherwise.
	Version int64
	// VersionType is External (the default) or ExternalGTE.
	VersionType string
	Doc         json.RawMessage // for an index operation
}

// Result is one bulk item's outcome.
type Result struct {
	ID     string
	Delete bool // the operation was a delete
	Status int
	// Result is the engine's word for what happened: created, updated,
	// deleted, not_found (a delete of a document that was not there), noop.
	Result string
	Type   string // error type, e.g. mapper_parsing_exception
	Reason string
}

// OK reports success: stored, deleted, already deleted (a delete answered
// 404 with the result not_found: the document is not there, which is what
// the delete wanted), or a conflict with a newer version (the engine has
// something newer). Any other 404 is a failure: an index operation, or a
// delete, answered index_not_found_exception found no index to write to
// (the index behind the alias is gone and auto-creation is off), and
// nothing was written.
func (r Result) OK() bool {
	switch {
	case r.Status < 300, r.Status == http.StatusConflict:
		return true
	case r.Status == http.StatusNotFound:
		return r.AlreadyDeleted()
	}
	return false
}

// AlreadyDeleted reports a delete of a document the index did not have.
func (r Result) AlreadyDeleted() bool {
	return r.Delete && r.Status == http.StatusNotFound && r.Result == "not_found" && r.Type == ""
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
			switch op.VersionType {
			case "", External:
				meta["version_type"] = External
			case ExternalGTE:
				meta["version_type"] = ExternalGTE
			default:
				return nil, fmt.Errorf("bulk: document %s: version type %q (want %s or %s)", op.ID, op.VersionType, External, ExternalGTE)
			}
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
			Result string `json:"result"`
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
			r := Result{ID: it.ID, Delete: ops[i].Delete, Status: it.Status, Result: it.Result}
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

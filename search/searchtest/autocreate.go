package searchtest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// settingsLockFile serializes the tests, of every test process on this
// machine, that change a cluster setting: two read-modify-write sequences
// interleaved would restore each other's values.
var settingsLockFile = filepath.Join(os.TempDir(), "fanout-searchtest-cluster-settings.lock")

// ForbidAutoCreate makes the engine refuse to create, on a write, any index
// whose name matches pattern (e.g. "t1a2b3c4d-products*"), the way a
// cluster configured with action.auto_create_index: false refuses every
// name: a write to such a missing index is answered 404
// index_not_found_exception. It changes the cluster setting
// action.auto_create_index for the test's own names only, prepending
// "-<pattern>" to what the setting allowed, so tests running meanwhile
// against the same node, with other names, see no difference; and it
// restores the setting's previous value when the test ends, failed or not.
// A test process killed before then leaves a pattern naming only its own
// random names behind. Tests using it run one at a time per machine.
func ForbidAutoCreate(t testing.TB, pattern string) {
	t.Helper()
	if strings.ContainsAny(pattern, ", ") || pattern == "" || pattern == "*" {
		t.Fatalf("searchtest: ForbidAutoCreate(%q): want a pattern of the test's own index names", pattern)
	}
	unlock := lockSettings(t)
	layer, previous, err := autoCreateSetting()
	if err != nil {
		unlock()
		t.Fatalf("searchtest: read action.auto_create_index: %v", err)
	}
	var value string
	switch strings.TrimSpace(previous) {
	case "false":
		// Nothing is auto-created already; setting it again is harmless and
		// keeps the restore path the same.
		value = "false"
	case "", "true":
		value = "-" + pattern + ",+*"
	default:
		value = "-" + pattern + "," + previous
	}
	restore := func() {
		defer unlock()
		var old any // null removes the setting: back to the default
		if previous != "" {
			old = previous
		}
		if err := putSetting(layer, old); err != nil {
			t.Errorf("searchtest: restore action.auto_create_index to %v: %v", old, err)
		}
	}
	if err := putSetting(layer, value); err != nil {
		restore()
		t.Fatalf("searchtest: set action.auto_create_index to %q: %v", value, err)
	}
	t.Cleanup(restore)
}

// autoCreateSetting returns the layer that decides action.auto_create_index
// (transient, if set there, wins over persistent) and its raw value there
// ("" when neither sets it: the default, true).
func autoCreateSetting() (layer, value string, err error) {
	var out map[string]map[string]any
	if err := call(http.MethodGet, "/_cluster/settings?flat_settings=true", nil, &out); err != nil {
		return "", "", err
	}
	for _, l := range []string{"transient", "persistent"} {
		if v, ok := out[l]["action.auto_create_index"]; ok {
			return l, fmt.Sprint(v), nil
		}
	}
	return "persistent", "", nil
}

func putSetting(layer string, value any) error {
	body, err := json.Marshal(map[string]any{layer: map[string]any{"action.auto_create_index": value}})
	if err != nil {
		return err
	}
	return call(http.MethodPut, "/_cluster/settings", body, nil)
}

// call talks to the engine directly: the settings are the test's fixture,
// not something fanout's client does.
func call(method, path string, body []byte, out any) error {
	req, err := http.NewRequest(method, URL()+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	hc := &http.Client{Timeout: 30 * time.Second, Transport: http.DefaultTransport.(*http.Transport).Clone()}
	defer hc.CloseIdleConnections()
	res, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	data, err := io.ReadAll(res.Body)
	if err != nil {
		return err
	}
	if res.StatusCode >= 300 {
		return fmt.Errorf("%s %s: %d %s", method, path, res.StatusCode, data)
	}
	if out != nil {
		return json.Unmarshal(data, out)
	}
	return nil
}

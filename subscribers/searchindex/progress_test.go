package searchindex

import (
	"bytes"
	"strings"
	"testing"
)

// Written to a file or a CI log, the load's progress is plain lines, not a
// bar's carriage-return frames.
func TestProgressIsPlainLinesOffATerminal(t *testing.T) {
	var out bytes.Buffer
	p := newProgress(&out, 20)
	for range 4 {
		p.add(5)
	}
	p.finish()
	got := out.String()
	if strings.ContainsRune(got, '\r') || strings.Count(got, "\n") != 1 || !strings.HasPrefix(got, "loading: 20 of 20 documents (100%), ") {
		t.Errorf("progress off a terminal: %q, want one plain line", got)
	}
	var none *progress // Progress unset: no output, no panic
	none.add(1)
	none.finish()
	if newProgress(nil, 5) != nil {
		t.Error("a nil writer got a progress display")
	}
}

package faultrun

import (
	"fmt"
	"strings"
	"testing"
)

// The fault run's check of a transaction over 1000 events (chunkProblems)
// passes one published in order, in chunks of at most 1000 each at
// consecutive sequences, and reports each way of breaking that.
func TestChunkProblems(t *testing.T) {
	t.Parallel()
	// stream lays out a transaction's chunks (their sizes) from sequence
	// 1, each event marked with its chunk, and applies edit to the marks
	// and sequences before the check.
	stream := func(sizes []int, edit func(seqs []uint64, marks []string)) []string {
		var seqs []uint64
		var marks []string
		for k, n := range sizes {
			last := ""
			if k == len(sizes)-1 {
				last = "true"
			}
			for range n {
				seqs = append(seqs, uint64(len(seqs)+1))
				marks = append(marks, fmt.Sprintf("42 chunk %d last %s", k+1, last))
			}
		}
		if edit != nil {
			edit(seqs, marks)
		}
		atSeq := map[uint64]event{}
		for i, seq := range seqs {
			atSeq[seq] = event{id: int64(100 + i), seq: seq, tx: marks[i]}
		}
		return chunkProblems(seqs, atSeq)
	}
	if p := stream([]int{1000, 1000, 500}, nil); len(p) > 0 {
		t.Fatalf("a transaction in order: %v", p)
	}
	if p := stream([]int{999, 1000, 2}, nil); len(p) > 0 {
		t.Fatalf("a transaction with a chunk short of a failed row: %v", p)
	}
	for name, tc := range map[string]struct {
		sizes []int
		edit  func(seqs []uint64, marks []string)
		want  string
	}{
		"chunks out of order": {[]int{1000, 1000, 500}, func(_ []uint64, marks []string) {
			for i := range marks {
				switch {
				case i < 1000:
					marks[i] = "42 chunk 2 last "
				case i < 2000:
					marks[i] = "42 chunk 1 last "
				}
			}
		}, "its first event in the stream"},
		"another message inside a chunk": {[]int{1000, 1000}, func(seqs []uint64, _ []string) {
			for i := 1500; i < len(seqs); i++ {
				seqs[i]++
			}
		}, "1 other messages between sequences 1500 and 1502"},
		"a chunk over 1000": {[]int{1001, 500}, nil, "holds over 1000"},
		"the last chunk not marked last": {[]int{1000, 500}, func(_ []uint64, marks []string) {
			for i := 1000; i < len(marks); i++ {
				marks[i] = "42 chunk 2 last "
			}
		}, "not marked last"},
		"a chunk after the last": {[]int{1000, 500}, func(_ []uint64, marks []string) {
			for i := range 1000 {
				marks[i] = "42 chunk 1 last true"
			}
		}, "after chunk 1 (marked last: true)"},
		"another transaction's mark": {[]int{1000, 500}, func(_ []uint64, marks []string) {
			marks[1200] = "43 chunk 2 last true"
		}, "marked transaction \"43\""},
		"unmarked": {[]int{1000, 500}, func(_ []uint64, marks []string) { marks[7] = "" }, "not as a transaction's chunk"},
	} {
		p := stream(tc.sizes, tc.edit)
		if len(p) == 0 || !strings.Contains(p[0], tc.want) {
			t.Errorf("%s: reported %q, want %q", name, p, tc.want)
		}
	}
}

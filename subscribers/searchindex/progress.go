package searchindex

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progressEvery is how often a load writes a progress line when its output
// is not a terminal.
const progressEvery = 5 * time.Second

// progress shows a load's progress: a bar on a terminal; elsewhere (a
// file, a CI log) a plain line every progressEvery and one at the end,
// where a bar's carriage-return frames would pile up by the hundred.
type progress struct {
	bar *progressbar.ProgressBar

	w     io.Writer
	total int64
	start time.Time
	mu    sync.Mutex
	done  int64
	last  time.Time
}

func newProgress(w io.Writer, total int64) *progress {
	if w == nil {
		return nil
	}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		return &progress{w: w, bar: progressbar.NewOptions64(total,
			progressbar.OptionSetWriter(w),
			progressbar.OptionSetDescription("loading"),
			progressbar.OptionShowCount(),
			progressbar.OptionShowIts(),
			progressbar.OptionSetItsString("docs"),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionThrottle(200*time.Millisecond),
			progressbar.OptionFullWidth(),
		)}
	}
	now := time.Now()
	return &progress{w: w, total: total, start: now, last: now}
}

func (p *progress) add(n int) {
	if p == nil {
		return
	}
	if p.bar != nil {
		_ = p.bar.Add(n)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done += int64(n)
	if now := time.Now(); now.Sub(p.last) >= progressEvery {
		p.last = now
		p.line()
	}
}

func (p *progress) finish() {
	if p == nil {
		return
	}
	if p.bar != nil {
		_ = p.bar.Finish()
		fmt.Fprintln(p.w)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.line()
}

// line writes one plain progress line; p.mu is held.
func (p *progress) line() {
	elapsed := time.Since(p.start)
	pct := 100.0
	if p.total > 0 {
		pct = 100 * float64(p.done) / float64(p.total)
	}
	fmt.Fprintf(p.w, "loading: %d of %d documents (%.0f%%), %.0f docs/s, %s elapsed\n",
		p.done, p.total, pct, float64(p.done)/max(elapsed.Seconds(), 1e-9), elapsed.Round(time.Second))
}

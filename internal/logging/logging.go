// Package logging builds the process logger: JSON in containers, text on a
// terminal, snake_case keys, the component on every line.
package logging

import (
	"io"
	"log/slog"
	"os"
	"strings"

	"golang.org/x/term"
)

// New returns a logger writing to w. format is json, text or auto (text when
// w is a terminal); level is debug, info, warn or error.
func New(w io.Writer, format, level string) *slog.Logger {
	var lv slog.Level
	switch strings.ToLower(level) {
	case "debug":
		lv = slog.LevelDebug
	case "warn":
		lv = slog.LevelWarn
	case "error":
		lv = slog.LevelError
	default:
		lv = slog.LevelInfo
	}
	opts := &slog.HandlerOptions{Level: lv}
	if format == "text" || (format == "auto" && isTerminal(w)) {
		return slog.New(slog.NewTextHandler(w, opts))
	}
	return slog.New(slog.NewJSONHandler(w, opts))
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// Component returns logger with the component attribute every line carries.
func Component(logger *slog.Logger, name string) *slog.Logger {
	return logger.With("component", name)
}

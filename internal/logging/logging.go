// Package logging builds the process logger: JSON in containers, text on a
// terminal, snake_case keys, the component on every line, no credential
// on any.
package logging

import (
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/fanout/fanout/internal/config"
	"golang.org/x/term"
)

// New returns a logger writing to w, credentials masked (see redactAttr).
// format is json, text or auto (text when w is a terminal); level is
// debug, info, warn or error.
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
	opts := &slog.HandlerOptions{Level: lv, ReplaceAttr: redactAttr}
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

// redactAttr keeps credentials out of every line, whoever wrote it: an
// attribute named like one (password, token, api_key, authorization:
// config.SecretName) shows "<redacted>", and strings and errors pass
// through config.RedactText, which masks URLs' passwords and secret
// parameters and key=value pairs. Values fanout logs are redacted where
// they are known (connection URLs, OTLP settings); this catches the
// messages of libraries, quoted in errors, that nobody vetted.
func redactAttr(_ []string, a slog.Attr) slog.Attr {
	var s string
	switch v := a.Value; v.Kind() {
	case slog.KindString:
		s = v.String()
	case slog.KindAny:
		err, isErr := v.Any().(error)
		switch {
		case isErr && err != nil:
			s = err.Error()
		case v.Any() != nil && config.SecretName(a.Key):
			return slog.String(a.Key, "<redacted>")
		default:
			return a
		}
	default:
		return a
	}
	if s != "" && config.SecretName(a.Key) {
		return slog.String(a.Key, "<redacted>")
	}
	if red := config.RedactText(s); red != s {
		return slog.String(a.Key, red)
	}
	return a
}

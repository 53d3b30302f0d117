package logging

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// A line never shows a credential, whichever attribute or message holds it,
// and shows everything else as it was.
func TestLinesHideCredentials(t *testing.T) {
	for _, format := range []string{"json", "text"} {
		var buf bytes.Buffer
		logger := Component(New(&buf, format, "debug"), "test")
		logger.Info("connecting to nats://relay:S3cretA@h:4222",
			"password", "S3cretB",
			"api_key", "S3cretC",
			"url", "postgres://fanout:S3cretD@db/fanout?sslmode=disable&sslpassword=S3cretE",
			"dsn", "host=db user=fanout password=S3cretF",
			"error", fmt.Errorf("dial: %w", errors.New(`parse "http://otel:S3cretG@h/%zz": invalid URL escape "%zz"`)),
			"header", "Authorization: Bearer S3cretH",
			"user", "fanout", "events", 3, "pending", "password_file is /run/secrets/pg",
		)
		out := buf.String()
		if strings.Contains(out, "S3cret") {
			t.Errorf("%s: a line shows a credential:\n%s", format, out)
		}
		for _, want := range []string{"relay:xxxxx@h:4222", "<redacted>", "fanout:xxxxx@db/fanout?sslmode=disable&sslpassword=xxxxx",
			"user=fanout password=xxxxx", "otel:xxxxx@h/%zz", "Bearer xxxxx", "fanout", "3", "component", "password_file is /run/secrets/pg"} {
			if !strings.Contains(out, want) {
				t.Errorf("%s: the line lacks %q:\n%s", format, want, out)
			}
		}
	}
}

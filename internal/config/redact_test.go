package config

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"testing"
)

func TestRedactURL(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		// Nothing to mask: shown as given.
		{"", ""},
		{"postgres://fanout@127.0.0.1:55432/fanout?sslmode=disable", "postgres://fanout@127.0.0.1:55432/fanout?sslmode=disable"},
		{"nats://127.0.0.1:4222,tls://nats-2:4222", "nats://127.0.0.1:4222,tls://nats-2:4222"},
		{"http://127.0.0.1:9200", "http://127.0.0.1:9200"},
		{"redis://cache@127.0.0.1:6379/0", "redis://cache@127.0.0.1:6379/0"},
		{"postgres://fanout@db/fanout?sslmode=verify-full&sslrootcert=/run/ca.pem&sslkey=/run/client.key",
			"postgres://fanout@db/fanout?sslmode=verify-full&sslrootcert=/run/ca.pem&sslkey=/run/client.key"},

		// User info.
		{"postgres://fanout:s3cret@db:5432/fanout", "postgres://fanout:xxxxx@db:5432/fanout"},
		{"redis://:s3cret@127.0.0.1:6379/0", "redis://:xxxxx@127.0.0.1:6379/0"},
		{"nats://relay:s3cret@127.0.0.1:4222", "nats://relay:xxxxx@127.0.0.1:4222"},
		{"nats://relay:@127.0.0.1:4222", "nats://relay:@127.0.0.1:4222"},
		{"postgres://fanout:p%40ss@db/fanout", "postgres://fanout:xxxxx@db/fanout"},
		// A password that holds a list separator, a '@', or (malformed) a
		// '/', '?' or '#'.
		{"postgres://fanout:s3,cret@db/fanout", "postgres://fanout:xxxxx@db/fanout"},
		{"http://elastic:12,34@h1:9200", "http://elastic:xxxxx@h1:9200"},
		{"postgres://fanout:s3@cret@db/fanout", "postgres://fanout:xxxxx@db/fanout"},
		{"postgres://fanout:s3/cret@db/fanout", "postgres://xxxxx@db/fanout"},
		{"postgres://fanout:12?34@db/fanout", "postgres://xxxxx@db/fanout"},
		{"nats://relay:12#34@db:4222", "nats://xxxxx@db:4222"},
		// A user alone is a token in NATS URLs, and often an API key in
		// HTTP ones.
		{"nats://s3cret@127.0.0.1:4222", "nats://xxxxx@127.0.0.1:4222"},
		{"tls://s3cret@nats:4222", "tls://xxxxx@nats:4222"},
		{"https://s3cret@collector/v1/traces", "https://xxxxx@collector/v1/traces"},
		{"natsx://s3cret@127.0.0.1:4222", "natsx://xxxxx@127.0.0.1:4222"},

		// Lists: each URL's credentials, whichever holds them.
		{"nats://a:s3cret@h1:4222,nats://b:s3cret2@h2:4222", "nats://a:xxxxx@h1:4222,nats://b:xxxxx@h2:4222"},
		{"nats://h1:4222, nats://s3cret@h2:4222", "nats://h1:4222, nats://xxxxx@h2:4222"},
		{"nats://h1:4222,b:s3cret@h2:4222", "nats://h1:xxxxx@h2:4222"},
		{"postgres://fanout:s3cret@h1:5432,h2:5432/fanout?target_session_attrs=read-write",
			"postgres://fanout:xxxxx@h1:5432,h2:5432/fanout?target_session_attrs=read-write"},
		// No scheme (refused by validation, which quotes it).
		{"relay:s3cret@127.0.0.1:4222", "relay:xxxxx@127.0.0.1:4222"},
		{"s3cret@127.0.0.1:4222", "xxxxx@127.0.0.1:4222"},

		// Query and fragment parameters.
		{"postgres://fanout@db/fanout?sslmode=disable&password=s3cret", "postgres://fanout@db/fanout?sslmode=disable&password=xxxxx"},
		{"postgres://fanout@db/fanout?sslpassword=s3cret&sslmode=require", "postgres://fanout@db/fanout?sslpassword=xxxxx&sslmode=require"},
		{"postgres://fanout@db/fanout?PASSWORD=s3cret", "postgres://fanout@db/fanout?PASSWORD=xxxxx"},
		{"postgres://fanout@db/fanout?pass%77ord=s3cret", "postgres://fanout@db/fanout?pass%77ord=xxxxx"},
		{"postgres://fanout@db/fanout?password=s3,cret", "postgres://fanout@db/fanout?password=xxxxx"},
		{"http://collector:4318/v1/traces?api_key=s3cret", "http://collector:4318/v1/traces?api_key=xxxxx"},
		{"http://collector:4318/v1/traces?api-key=s3cret&x=1", "http://collector:4318/v1/traces?api-key=xxxxx&x=1"},
		{"http://collector?apiKey=s3cret;token=s3cret2", "http://collector?apiKey=xxxxx;token=xxxxx"},
		{"https://h/p?access_token=s3cret&key=s3cret2&sig=s3cret3", "https://h/p?access_token=xxxxx&key=xxxxx&sig=xxxxx"},
		{"https://h/p?X-Amz-Signature=s3cret&X-Amz-Security-Token=s3cret2", "https://h/p?X-Amz-Signature=xxxxx&X-Amz-Security-Token=xxxxx"},
		{"https://h/p#access_token=s3cret&state=1", "https://h/p#access_token=xxxxx&state=1"},
		{"http://h?token=s3cret@x", "http://xxxxx@x"},
		{"nats://h1?token=s3cret,nats://h2", "nats://h1?token=xxxxx,nats://h2"},

		// libpq keyword/value strings (pgx takes them; fanout's validation
		// refuses and quotes them).
		{"host=db port=5432 user=fanout password=s3cret sslmode=disable", "host=db port=5432 user=fanout password=xxxxx sslmode=disable"},
		{"host=db password='s3 cr\\'et' user=fanout", "host=db password=xxxxx user=fanout"},
		{"host=db password = s3cret", "host=db password = xxxxx"},
		{"password=s3cret", "password=xxxxx"},
		{"host=db sslpassword=s3cret,x", "host=db sslpassword=xxxxx"},
		{"host=db oops s3cret", "host=db xxxxx"},
	} {
		if got := RedactURL(tc.in); got != tc.want {
			t.Errorf("RedactURL(%q)\n got %q\nwant %q", tc.in, got, tc.want)
		}
		if strings.Contains(tc.in, "s3") && strings.Contains(RedactURL(tc.in), "s3") {
			t.Errorf("RedactURL(%q) = %q shows a secret", tc.in, RedactURL(tc.in))
		}
	}
}

func TestURLSecrets(t *testing.T) {
	got := URLSecrets("postgres://fanout:p%40ss@db/fanout?sslmode=disable&password=q1&sslpassword=q2")
	for _, want := range []string{"p%40ss", "p@ss", "q1", "q2"} {
		if !slices.Contains(got, want) {
			t.Errorf("URLSecrets misses %q: %q", want, got)
		}
	}
	if slices.Contains(got, "disable") || slices.Contains(got, "fanout") {
		t.Errorf("URLSecrets returns what is not secret: %q", got)
	}
}

func TestSecretName(t *testing.T) {
	for _, name := range []string{"password", "Password", "sslpassword", "passwd", "pwd", "pass", "passphrase",
		"token", "access_token", "X-Auth-Token", "secret", "client_secret", "apikey", "api_key", "api-key", "apiKey",
		"X-Api-Key", "key", "private_key", "sig", "X-Amz-Signature", "X-Amz-Credential", "authorization", "Cookie"} {
		if !SecretName(name) {
			t.Errorf("SecretName(%q) = false", name)
		}
	}
	for _, name := range []string{"user", "username", "sslmode", "sslkey", "sslcert", "sslrootcert", "host", "db",
		"application_name", "target_session_attrs", "connect_timeout", "keys", "subscriber", "component", "error"} {
		if SecretName(name) {
			t.Errorf("SecretName(%q) = true", name)
		}
	}
}

func TestRedactText(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"plain message", "plain message"},
		{`parse "http://otel:s3cret@h:1/%zz?api_key=s3cret2": invalid URL escape "%zz"`,
			`parse "http://otel:xxxxx@h:1/%zz?api_key=xxxxx": invalid URL escape "%zz"`},
		{"connect to nats at nats://s3cret@h:4222: nats: no servers available", "connect to nats at nats://xxxxx@h:4222: nats: no servers available"},
		{"cannot parse `host=db password=s3cret`: failed", "cannot parse `host=db password=xxxxx`: failed"},
		{"failed to connect to `user=fanout database=fanout`: refused", "failed to connect to `user=fanout database=fanout`: refused"},
		{`password="s3 cret" next`, "password=xxxxx next"},
		{"authorization=Bearer s3cret", "authorization=xxxxx xxxxx"},
		{"authorization=Bearer%20s3cret,x-api-key=s3cret2", "authorization=xxxxx"},
		{"Authorization: Bearer s3cret", "Authorization: Bearer xxxxx"},
	} {
		if got := RedactText(tc.in); got != tc.want {
			t.Errorf("RedactText(%q)\n got %q\nwant %q", tc.in, got, tc.want)
		}
	}
}

func TestRedactError(t *testing.T) {
	_, cause := os.Open("/nonexistent/s3cret")
	err := fmt.Errorf("dial with s3cret and s3%%2Fcret: %w", cause)
	red := RedactError(err, "s3cret", "s3/cret")
	if strings.Contains(red.Error(), "s3") {
		t.Errorf("RedactError shows a secret: %v", red)
	}
	if !errors.Is(red, fs.ErrNotExist) {
		t.Errorf("RedactError broke the error chain: %v", red)
	}
	if clean := errors.New("refused"); RedactError(clean, "s3cret") != clean {
		t.Error("RedactError wrapped an error that holds no secret")
	}
	if RedactError(nil, "x") != nil {
		t.Error("RedactError(nil) is not nil")
	}
}

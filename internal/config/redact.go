package config

import (
	"net/url"
	"regexp"
	"strings"
)

// Mask is what fanout prints in a credential's place: in URLs, where the
// key (password=xxxxx) or the user (relay:xxxxx@) still shows that one is
// set, as net/url's Redacted does.
const Mask = "xxxxx"

// SecretName reports whether a query parameter, libpq keyword, header or
// log attribute of this name carries a credential, so that its value is
// never printed. Names are compared in lower case without '-', '_' and
// '.', so api_key, api-key, apiKey and X-Api-Key are one name.
//
// The list errs on the side of masking: a harmless value hidden costs a
// look at the configuration source, a credential shown costs a rotation.
// It covers libpq's password and sslpassword (pgx takes both from a URL's
// query), the usual spellings of passwords and API keys, OAuth tokens
// (access_token, refresh_token, id_token), cloud signatures (sig,
// X-Amz-Signature, X-Amz-Security-Token, X-Amz-Credential), the bare key=
// of API-key query strings, and HTTP authorization and cookie headers. It
// does not cover names of files holding credentials (sslkey, sslcert,
// *_file): paths are not secrets, and seeing them helps.
func SecretName(name string) bool {
	n := strings.ToLower(name)
	n = strings.NewReplacer("-", "", "_", "", ".", "", " ", "").Replace(n)
	switch n {
	case "key", "pass", "sig", "auth", "cookie", "setcookie":
		return true
	}
	for _, w := range secretWords {
		if strings.Contains(n, w) {
			return true
		}
	}
	return false
}

var secretWords = []string{
	"password", "passwd", "pwd", "passphrase", "secret", "token",
	"apikey", "accesskey", "privatekey", "credential", "signature", "authorization",
}

// userSchemes are the schemes whose URLs name a user without a password
// in the user info (postgres://fanout@host). Elsewhere a lone user is
// masked: nats.go sends it as a token (nats://<token>@host), and HTTP
// services commonly take an API key there (https://<key>@host).
var userSchemes = map[string]bool{"postgres": true, "postgresql": true, "redis": true, "rediss": true, "unix": true}

// RedactURL masks the credentials in a URL, a comma-separated list of
// them, or a libpq keyword/value string, for messages, logs and `config
// print`: the password of the user info (and a user that is a token, see
// userSchemes), and the values of query and fragment parameters that
// SecretName names (?password=, ?sslpassword=, ?api_key=, ...). Everything
// else is kept, so the result still says where it connects.
//
// It works on the text rather than on url.Parse's result, because the
// values it sees most are the ones that failed validation: a password
// with a ',' (a list separator), a '/', '?' or '#' must not leak through a
// parser's misreading of it. When the text is ambiguous it masks more.
func RedactURL(s string) string {
	return redact(s, nil)
}

// URLSecrets returns the credentials RedactURL masks in s, as written
// and as decoded, for scrubbing them from messages of libraries that
// might quote them (see RedactError).
func URLSecrets(s string) []string {
	var out []string
	redact(s, func(v string) {
		out = append(out, v)
		if d, err := url.PathUnescape(v); err == nil && d != v {
			out = append(out, d)
		}
	})
	return out
}

// redact masks s's credentials and reports each to found (if not nil).
func redact(s string, found func(string)) string {
	if found == nil {
		found = func(string) {}
	}
	if isKeywordValue(s) {
		return redactKeywordValue(s, found)
	}
	var b strings.Builder
	for _, seg := range urlSegments(s) {
		b.WriteString(redactSegment(seg, found))
	}
	return b.String()
}

// urlSegments cuts s before each URL's scheme ("nats://a@h1,nats://b@h2"
// into "nats://a@h1," and "nats://b@h2"); text before the first scheme is
// a segment of its own. A segment therefore holds one URL's user info
// whole, commas and all.
func urlSegments(s string) []string {
	var segs []string
	start := 0
	for _, m := range schemeStart.FindAllStringIndex(s, -1) {
		if m[0] > start {
			segs = append(segs, s[start:m[0]])
			start = m[0]
		}
	}
	return append(segs, s[start:])
}

// schemeStart finds a URL's scheme and the "://" after it.
var schemeStart = regexp.MustCompile(`[A-Za-z0-9+.-]*://`)

// redactSegment masks one URL (or scheme-less host list) of a segment.
func redactSegment(seg string, found func(string)) string {
	body := strings.TrimRight(seg, ", \t")
	sep := seg[len(body):]
	scheme, rest, hasScheme := strings.Cut(body, "://")
	if !hasScheme {
		scheme, rest = "", body
	}
	var b strings.Builder
	if hasScheme {
		b.WriteString(scheme + "://")
	}
	// The user info ends at the last '@', as in net/url. Without a '/',
	// '?' or '#' in front of it, it is user[:password]; with one, the URL
	// is malformed or the '@' belongs to a path or query, and all of it is
	// masked rather than guessed at.
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		b.WriteString(redactUserinfo(scheme, rest[:at], found))
		b.WriteByte('@')
		rest = rest[at+1:]
	}
	hostPath, fragment, hasFragment := strings.Cut(rest, "#")
	hostPath, query, hasQuery := strings.Cut(hostPath, "?")
	b.WriteString(hostPath)
	if hasQuery {
		b.WriteString("?" + redactParams(query, found))
	}
	if hasFragment {
		b.WriteString("#" + redactParams(fragment, found))
	}
	return b.String() + sep
}

func redactUserinfo(scheme, ui string, found func(string)) string {
	if ui == "" {
		return ""
	}
	if strings.ContainsAny(ui, "/?#") {
		found(ui)
		return Mask
	}
	user, pass, hasPass := strings.Cut(ui, ":")
	switch {
	case hasPass && pass == "":
		return ui
	case hasPass:
		found(pass)
		return user + ":" + Mask
	case userSchemes[strings.ToLower(scheme)]:
		return ui
	default:
		found(user)
		return Mask
	}
}

// redactParams masks the secret values of a query or fragment
// (a=1&password=2), keeping every other byte as it was.
func redactParams(q string, found func(string)) string {
	return param.ReplaceAllStringFunc(q, func(pair string) string {
		key, value, _ := strings.Cut(pair, "=")
		name, err := url.QueryUnescape(key)
		if err != nil {
			name = key
		}
		if value == "" || !SecretName(name) {
			return pair
		}
		found(value)
		return key + "=" + Mask
	})
}

// param is a key=value pair of a query or fragment, between its '&' or ';'.
var param = regexp.MustCompile(`[^&;=]*=[^&;]*`)

// keywordValue matches the start of a libpq keyword/value connection
// string ("host=db password=..."), which pgx accepts as well as URLs.
var keywordValue = regexp.MustCompile(`^\s*[A-Za-z_][A-Za-z0-9_]*\s*=`)

func isKeywordValue(s string) bool {
	return !strings.Contains(s, "://") && keywordValue.MatchString(s)
}

// keywordPair is one pair of a libpq keyword/value string, read as libpq
// reads it: the key and '=' with optional spaces around it (the head),
// then the value, single-quoted with backslash escapes or up to the next
// space.
var keywordPair = regexp.MustCompile(`(?s)^(([^= \t\n\r]*)[ \t\n\r]*=[ \t\n\r]*)('(?:\\.|[^'\\])*(?:'|\\?$)|(?:\\.|[^ \t\n\r\\])*\\?)`)

// redactKeywordValue masks the secret values of a libpq keyword/value
// string. A part it cannot read is masked, with all that follows it.
func redactKeywordValue(s string, found func(string)) string {
	var b strings.Builder
	for {
		pair := strings.TrimLeft(s, " \t\n\r")
		b.WriteString(s[:len(s)-len(pair)])
		if pair == "" {
			return b.String()
		}
		m := keywordPair.FindStringSubmatch(pair)
		if m == nil {
			found(pair)
			return b.String() + Mask
		}
		head, key, value := m[1], m[2], m[3]
		if value != "" && SecretName(key) {
			found(value)
			if strings.HasPrefix(value, "'") {
				found(strings.Trim(value, "'"))
			}
			value = Mask
		}
		b.WriteString(head + value)
		s = pair[len(m[0]):]
	}
}

// textURL finds URLs in free text: a scheme, "://", then up to a space or
// a quote (error messages quote URLs: parse "http://...": ...).
var textURL = regexp.MustCompile("[A-Za-z][A-Za-z0-9+.-]*://[^\\s\"'`<>]*")

// textPair finds key=value pairs in free text; the value is quoted or runs
// to a space, quote or '&'.
var textPair = regexp.MustCompile(`([A-Za-z][A-Za-z0-9_.-]*)=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s&'"` + "`" + `]*)`)

// textAuth finds a bearer token ("Authorization: Bearer <token>"), the
// form of most API credentials in HTTP headers.
var textAuth = regexp.MustCompile(`(?i)\b(bearer)(\s+|%20)[^\s"'&,` + "`" + `]+`)

// RedactText masks what looks like a credential in free text, such as a
// library's error message or a log attribute: URLs as RedactURL does,
// key=value pairs whose key SecretName names, and "Bearer <token>". It is
// the last line of defence, for text whose makers did not know better;
// values fanout prints itself are redacted where they are known.
func RedactText(s string) string {
	if !strings.Contains(s, "=") && !strings.Contains(s, "://") && !strings.Contains(strings.ToLower(s), "bearer") {
		return s
	}
	// The bearer token first: "authorization=Bearer <token>" is a pair
	// whose value would otherwise end at the space.
	s = textAuth.ReplaceAllString(s, "${1}${2}"+Mask)
	s = textURL.ReplaceAllStringFunc(s, RedactURL)
	s = textPair.ReplaceAllStringFunc(s, func(m string) string {
		key, value, _ := strings.Cut(m, "=")
		if value == "" || !SecretName(key) || value == Mask {
			return m
		}
		return key + "=" + Mask
	})
	return s
}

// RedactError returns err with its message passed through RedactText and
// each of secrets (the credentials the caller used, and their URL
// encodings) masked: for errors of libraries that may quote what they
// were given. errors.Is and errors.As still see err's chain.
//
// Secrets shorter than minScrubbed are not searched for: masking every
// "1" of a message would leave nothing to read, and such a value protects
// nothing anyway. RedactText's masking by form still applies to them.
func RedactError(err error, secrets ...string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	red := msg
	for _, s := range secrets {
		if len(s) < minScrubbed {
			continue
		}
		for _, form := range []string{s, url.QueryEscape(s), url.PathEscape(s)} {
			red = strings.ReplaceAll(red, form, Mask)
		}
	}
	red = RedactText(red)
	if red == msg {
		return err
	}
	return &redactedError{msg: red, err: err}
}

const minScrubbed = 4

type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }

package stream

import "strings"

// ValidSubjectToken reports whether s can be one token of a subject that a
// stream stores: non-empty, printable, without '.', '*', '>' or whitespace.
func ValidSubjectToken(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if r <= ' ' || r == 0x7f || r == '.' || r == '*' || r == '>' {
			return false
		}
	}
	return true
}

// Subject is the subject an event type is published to under prefix.
func Subject(prefix, eventType string) string {
	return prefix + "." + eventType
}

// SubjectMatches reports whether subject (no wildcards) is one filter
// names: a token for a token, '*' for any one token, '>' for one or more
// at the end.
func SubjectMatches(filter, subject string) bool {
	fs, ss := strings.Split(filter, "."), strings.Split(subject, ".")
	for i, f := range fs {
		if f == ">" {
			return i == len(fs)-1 && len(ss) > i
		}
		if i >= len(ss) || (f != "*" && f != ss[i]) {
			return false
		}
	}
	return len(fs) == len(ss)
}

package stream

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

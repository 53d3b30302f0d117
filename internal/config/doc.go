// Package config layers fanout's configuration sources: built-in defaults,
// then an optional YAML file, then FANOUT_* environment variables, each
// overriding the one before. It knows no setting itself: the package that
// owns a section declares it (a struct with koanf tags, its field comments
// stating the default and the valid range), defaults it and validates it,
// naming the key in every error; the program composes the sections it runs
// with and the rules that tie them together (cmd/fanout), and Load derives
// the keys, the defaults and the checks from that composite. A bad setting
// stops a role at start rather than at 3 a.m.
//
// Environment variables spell the key in upper case with every "." replaced
// by "_": relay.batch_size is FANOUT_RELAY_BATCH_SIZE. Keys that contain
// underscores still work because the name is matched against the known keys,
// not split on underscores. Secrets (passwords, tokens) may also be given as
// a path in the matching *_file key, for container secrets.
//
// It also masks credentials for messages, logs and `fanout config print`
// (RedactURL, RedactError, SecretName): it imports nothing of fanout's, so
// every package may use it.
package config

// Package config loads fanout's configuration: built-in defaults, then an
// optional YAML file, then FANOUT_* environment variables, each layer
// overriding the one before. Load validates the result and names the key in
// every error, so a bad setting stops a role at start rather than at 3 a.m.
//
// Environment variables spell the key in upper case with every "." replaced
// by "_": relay.batch_size is FANOUT_RELAY_BATCH_SIZE. Keys that contain
// underscores still work because the name is matched against the known keys,
// not split on underscores. Secrets (passwords, tokens) may also be given as
// a path in the matching *_file key, for container secrets.
package config

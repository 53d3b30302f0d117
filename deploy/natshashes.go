package deploy

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/crypto/bcrypt"
)

// The NATS server needs only the bcrypt hashes of its users' passwords:
// given the plain ones in its environment, anyone who can read that
// environment (the container's user, root on the host, a crash dump) can
// log in as any role. HashNATSPasswords writes, for each NATS password
// file (nats_<user>_password) of a secrets directory, its hash
// (nats_<user>_password.bcrypt) into another, which is all the server's
// container mounts (compose.yaml: the nats-hashes job).

// NATSHashSuffix ends the name of a password's hash file.
const NATSHashSuffix = ".bcrypt"

// natsHashCost is bcrypt's cost: a login checks one hash, once per
// connection.
const natsHashCost = 11

// HashNATSPasswords hashes every nats_*_password file of from into to and
// returns the names of the hash files it wrote. A hash that still matches
// its password is kept (a run changes nothing then); one that does not is
// written again. A password is read as the roles read it: its trailing
// line ends dropped.
func HashNATSPasswords(from, to string) (written []string, err error) {
	paths, err := filepath.Glob(filepath.Join(from, "nats_*_password"))
	if err != nil {
		return nil, err
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("no NATS password (nats_*_password) in %s: run deploy/secrets/generate.sh", from)
	}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			return written, err
		}
		pw := strings.TrimRight(string(b), "\r\n")
		if pw == "" {
			return written, fmt.Errorf("%s is empty", p)
		}
		name := filepath.Base(p) + NATSHashSuffix
		out := filepath.Join(to, name)
		if have, err := os.ReadFile(out); err == nil && bcrypt.CompareHashAndPassword([]byte(strings.TrimSpace(string(have))), []byte(pw)) == nil {
			continue
		} else if err != nil && !errors.Is(err, os.ErrNotExist) {
			return written, err
		}
		h, err := bcrypt.GenerateFromPassword([]byte(pw), natsHashCost)
		if err != nil {
			return written, fmt.Errorf("%s: %w", p, err)
		}
		// Written whole, then renamed: the server never reads half a hash.
		tmp := out + ".tmp"
		if err := os.WriteFile(tmp, h, 0o644); err != nil {
			return written, err
		}
		if err := os.Rename(tmp, out); err != nil {
			return written, err
		}
		written = append(written, name)
	}
	return written, nil
}

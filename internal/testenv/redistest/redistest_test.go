package redistest

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
)

// The server answering on a test's port is that test's own process.
func TestStartedServerIsOurs(t *testing.T) {
	s := Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: s.Addr})
	defer rdb.Close()
	if err := ours(rdb, s.cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if err := ours(rdb, s.cmd.Process.Pid+1); err == nil {
		t.Fatal("another pid passes for this server")
	}
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
}

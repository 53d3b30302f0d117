// Package getter stands in for github.com/hashicorp/go-getter in this
// repository's build of task (go.mod replaces it here). Task uses go-getter
// for one thing, fetching a Taskfile included from a git URL, and go-getter
// brings the AWS and Google Cloud SDKs and gRPC with it: 580 of task's 942
// packages, and 158 of the 243 CPU-seconds its first build took on a
// 2-core machine (130 s before `go tool task test` could start anything).
// fanout's Taskfile includes nothing remote, so a remote include fails
// here with an error that says why; nothing else of task changes.
package getter

import (
	"context"
	"errors"
)

// ClientMode is go-getter's: what a Client fetches.
type ClientMode uint

// The modes go-getter declares, in its order.
const (
	ClientModeInvalid ClientMode = iota
	ClientModeAny
	ClientModeFile
	ClientModeDir
)

// Client has the fields task sets on go-getter's Client.
type Client struct {
	Ctx  context.Context
	Src  string
	Dst  string
	Mode ClientMode
}

// ErrRemoteTaskfile is what every Get returns.
var ErrRemoteTaskfile = errors.New("remote Taskfiles are not built into this repository's task (go.mod replaces github.com/hashicorp/go-getter with internal/tools/nogetter; see docs/testing.md)")

// Get fetches nothing.
func (c *Client) Get() error { return ErrRemoteTaskfile }

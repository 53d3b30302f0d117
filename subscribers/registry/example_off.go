//go:build !fanout_example

package registry

import "github.com/fanout/fanout/subscribers"

var tagged []subscribers.Declaration

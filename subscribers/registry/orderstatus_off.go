//go:build !fanout_orderstatus

package registry

import "github.com/fanout/fanout/subscribers"

var taggedOrderStatus []subscribers.Declaration

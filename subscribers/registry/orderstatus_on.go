//go:build fanout_orderstatus

package registry

import (
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/orderstatus"
)

// Built with the fanout_orderstatus tag (the fault run's late join), the
// registry also lists the test subscriber that keeps a copy of each order's
// status.
var taggedOrderStatus = []subscribers.Declaration{orderstatus.Subscriber}

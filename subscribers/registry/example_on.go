//go:build fanout_example

package registry

import (
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/example"
)

// Built with the fanout_example tag (tests only), the registry also lists
// the template subscriber: one line, as for any new subscriber.
var tagged = []subscribers.Declaration{example.Subscriber}

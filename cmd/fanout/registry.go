package main

import (
	"github.com/fanout/fanout/subscribers/registry"
)

// subscriberRegistry is what every command knows of the subscribers: the
// declarations in package subscribers/registry.
var subscriberRegistry = registry.Default

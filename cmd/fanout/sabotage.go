package main

import (
	"github.com/fanout/fanout/internal/testhooks"
	"github.com/fanout/fanout/subscribers"
)

// sabotage is deliberately broken behaviour for the fault run's self-test
// (faultrun proves its checker catches each kind). It stays empty in
// every binary but one built with the fanout_sabotage tag and started with
// FANOUT_TEST_SABOTAGE naming a kind (sabotage_on.go).
var sabotage struct {
	relay      testhooks.Relay
	subscriber testhooks.Subscriber
	// handler, if set, wraps each subscriber's handler (d's); backfill,
	// the handler a backfill runs.
	handler  func(d subscribers.Declaration, h subscribers.Handler) subscribers.Handler
	backfill func(subscribers.Handler) subscribers.Handler
}

// sabotaged wraps d's handler h if a sabotage asks for it.
func sabotaged(d subscribers.Declaration, h subscribers.Handler) subscribers.Handler {
	if sabotage.handler == nil {
		return h
	}
	return sabotage.handler(d, h)
}

// sabotagedBackfill wraps a backfill's h if a sabotage asks for it.
func sabotagedBackfill(h subscribers.Handler) subscribers.Handler {
	if sabotage.backfill == nil {
		return h
	}
	return sabotage.backfill(h)
}

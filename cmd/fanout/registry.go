package main

import (
	"io"
	"log/slog"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/cacheinval"
	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/fanout/fanout/subscribers/salesledger"
	"github.com/fanout/fanout/subscribers/searchindex"
)

// registry lists every subscriber `fanout subscribe` can run. Adding a
// subscriber is one line here (plus its package and a deploy entry).
var registry = map[string]func(*deps) (subscribers.Handler, error){
	invoicing.Name:   func(*deps) (subscribers.Handler, error) { return invoicing.New(), nil },
	cacheinval.Name:  func(d *deps) (subscribers.Handler, error) { return cacheinval.New(d.cache(), d.pool), nil },
	searchindex.Name: func(d *deps) (subscribers.Handler, error) { return d.searchIndexer() },
	salesledger.Name: func(*deps) (subscribers.Handler, error) { return salesledger.New(), nil },
}

// declarations build each subscriber's handler without its connections:
// enough for what it declares (its name and event types), which is all
// `fanout provision` needs. TestRegistryAndDeclarationsAgree keeps the two
// lists in step.
var declarations = map[string]func(*config.Config) subscribers.Handler{
	invoicing.Name:   func(*config.Config) subscribers.Handler { return invoicing.New() },
	cacheinval.Name:  func(*config.Config) subscribers.Handler { return cacheinval.New(nil, nil) },
	searchindex.Name: func(c *config.Config) subscribers.Handler { return searchindex.New(nil, nil, c.Search, discardLogger) },
	salesledger.Name: func(*config.Config) subscribers.Handler { return salesledger.New() },
}

var discardLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

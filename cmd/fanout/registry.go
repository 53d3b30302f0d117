package main

import (
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

// Package shop is the demo domain whose writes fanout carries: a catalog
// (brands, categories, products with stock) and orders. Each writer changes
// business rows and records its event with outbox.Write in the same
// transaction, the way a real application uses fanout. The demo, the tests,
// the benchmarks and the fault-injection run all write through it.
//
// Every change to anything in a product's search document (the product row,
// its stock, its brand's or its category's name) bumps products.version in
// the same transaction. Caches and the search index read the state with its version
// from Postgres and compare versions, never event ids (allocated in one order,
// committed in another), to refuse an older state over a newer one.
//
// The hot writers (UpdatePrice, ChangeStock) send their statements and the
// outbox insert in one pipelined round trip with outbox.Queue.
package shop

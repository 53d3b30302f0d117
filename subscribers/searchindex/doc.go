// Package searchindex keeps the search index in step with SQL: the
// subscriber that indexes product documents as they change, and the
// zero-downtime reindex (`fanout reindex`).
//
// # Documents and their versions
//
// A product's document is the SQL join of products, brands, categories and
// inventory (shop.Product), read when the event is handled, not taken from
// the event. It is written under the product id through the alias
// (search.alias, "products") with external versioning: the version is
// products.version, read in the same snapshot as the document and bumped by
// every change to anything in it. So when several indexer instances race on
// one product, the engine keeps the newest state whatever order the writes
// arrive in (an older one gets 409, which counts as done). Outbox ids could
// not serve: they are allocated in one order and committed in another.
//
// A product that no longer exists is deleted with the version DeletedVersion,
// above any real version: product ids are never reused, so nothing may
// overwrite a deletion. The engine remembers a deletion's version for
// index.gc_deletes (10 minutes in our mapping), far longer than any
// in-flight write can take (a handler call is cut off after
// subscribers.handler_timeout), so a late stale write cannot bring a deleted
// product back. `fanout reindex --check` would catch one that did.
//
// # Batches
//
// Events of a batch coalesce: each product is loaded once, whatever number
// of events named it, and a brand.updated or category.updated event
// re-indexes every product of the brand or category. All the batch's
// documents go in bulk requests; every item of the response is read (a 200
// with errors: true is a partial failure). 429 and 5xx items are retried
// with backoff, then the events are redelivered; 409 counts as done, and so
// does a 404 on the deletion of a document already gone. Any other 404
// wrote nothing (index_not_found_exception: the index behind the alias is
// gone and the engine may not create one): a failure, retried and then
// dead-lettered with the engine's reason after subscribers.max_failures.
// Any other 4xx (a document the mapping rejects) sends the events that
// named it to the dead letters at once, with the document id and the
// engine's reason. An event is acked only when all its documents succeeded.
//
// # Repairs
//
// `fanout reindex --check --repair` and `fanout reindex rollback` write with
// external_gte instead (Repair says why), read every document back, and
// report what they fixed and what they could not, with the reason.
package searchindex

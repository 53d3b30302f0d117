package shop

import (
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"

	"github.com/fanout/fanout/events"
	"github.com/fanout/fanout/outbox"
)

//go:embed eventtypes/*.json eventtypes/released/*.json
var declarations embed.FS

// EventTypes declares each of the shop's event types (shop/eventtypes, one
// JSON Schema a type): its aggregate, version, description and what its
// payload must be. The shop's writers refuse an event it does not allow,
// and `fanout relay` marks such a row written some other way failed.
var EventTypes = events.MustLoad(must(fs.Sub(declarations, "eventtypes")))

// ReleasedEventTypes are the declarations as last released
// (shop/eventtypes/released): EventTypes must keep every promise they
// made (events.BreaksRelease, `fanout events check`). A release copies
// shop/eventtypes/*.json there.
func ReleasedEventTypes() (*events.Catalog, error) {
	return events.Load(must(fs.Sub(declarations, "eventtypes/released")))
}

func must(fsys fs.FS, err error) fs.FS {
	if err != nil {
		panic(err)
	}
	return fsys
}

// writer writes the shop's events, checked against EventTypes.
var writer = outbox.NewWriter(outbox.DefaultWakeInterval, outbox.CheckedAgainst(EventTypes))

// Event types. Each becomes the subject events.<type>.
const (
	ProductCreated      = "product.created"
	ProductUpdated      = "product.updated"
	ProductStockChanged = "product.stock_changed"
	ProductDeleted      = "product.deleted"
	BrandUpdated        = "brand.updated"
	CategoryUpdated     = "category.updated"
	OrderCreated        = "order.created"
	OrderPaid           = "order.paid"
	OrderShipped        = "order.shipped"
	OrderDelivered      = "order.delivered"
	OrderCancelled      = "order.cancelled"
)

// An order's statuses. An order is created, then paid, shipped and
// delivered; it may be cancelled until it is delivered. Nothing follows
// delivered or cancelled.
const (
	StatusCreated   = "created"
	StatusPaid      = "paid"
	StatusShipped   = "shipped"
	StatusDelivered = "delivered"
	StatusCancelled = "cancelled"
)

// TransitionFrom lists, for each status an order can move to, the statuses
// it can move from.
var TransitionFrom = map[string][]string{
	StatusPaid:      {StatusCreated},
	StatusShipped:   {StatusPaid},
	StatusDelivered: {StatusShipped},
	StatusCancelled: {StatusCreated, StatusPaid, StatusShipped},
}

// Aggregate types.
const (
	AggregateProduct  = "product"
	AggregateBrand    = "brand"
	AggregateCategory = "category"
	AggregateOrder    = "order"
)

// ProductEvent is the payload of every product.* event. It says what
// happened, not the product's whole state: subscribers that need the state
// (the search document, the cache) read it from Postgres, with its version.
type ProductEvent struct {
	ProductID int64 `json:"product_id"`
	// Version is set by product.created (1) and product.deleted (the
	// version the product had when it was deleted).
	Version int64 `json:"version,omitempty"`
	// PriceCents is set by product.updated and product.created.
	PriceCents *int64 `json:"price_cents,omitempty"`
	// Stock is set by product.created.
	Stock *int `json:"stock,omitempty"`
	// StockDelta is set by product.stock_changed (the stock never goes
	// below zero, so the change applied may be smaller).
	StockDelta *int `json:"stock_delta,omitempty"`
}

// BrandEvent is the payload of brand.updated.
type BrandEvent struct {
	BrandID int64  `json:"brand_id"`
	Name    string `json:"name"`
	// Products is how many products the rename touched (each one's version
	// was bumped in the same transaction).
	Products int `json:"products"`
}

// CategoryEvent is the payload of category.updated.
type CategoryEvent struct {
	CategoryID int64  `json:"category_id"`
	Name       string `json:"name"`
	// Products is how many products the rename touched (each one's version
	// was bumped in the same transaction).
	Products int `json:"products"`
}

// OrderEvent is the payload of order.created.
type OrderEvent struct {
	OrderID  int64  `json:"order_id"`
	Customer string `json:"customer"`
	Lines    int    `json:"lines"`
}

// ErrMalformedOrderEvent is wrapped by ParseOrderEvent's errors: the
// payload is not an order.created's.
var ErrMalformedOrderEvent = errors.New("malformed order.created payload")

// ParseOrderEvent reads an order.created payload, which must name an
// order (a positive order_id).
func ParseOrderEvent(payload []byte) (OrderEvent, error) {
	var p OrderEvent
	if err := json.Unmarshal(payload, &p); err != nil {
		return p, fmt.Errorf("%w: %v", ErrMalformedOrderEvent, err)
	}
	if p.OrderID <= 0 {
		return p, fmt.Errorf("%w: no order_id in %.200s", ErrMalformedOrderEvent, payload)
	}
	return p, nil
}

// OrderTransition is the payload of order.paid, order.shipped,
// order.delivered and order.cancelled: the order moved from one status to
// another, as its N-th transition (its creation is the first). It carries
// everything a subscriber needs to follow the order's life from the events
// alone, in order.
type OrderTransition struct {
	OrderID int64  `json:"order_id"`
	From    string `json:"from"`
	To      string `json:"to"`
	N       int    `json:"n"`
}

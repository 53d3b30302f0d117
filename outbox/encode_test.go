package outbox

import (
	"strconv"
	"testing"
)

// The writer's hot path: an event as the shop writes it, with and without a
// trace context.
func BenchmarkEncode(b *testing.B) {
	type price struct {
		ProductID  int64 `json:"product_id"`
		PriceCents int64 `json:"price_cents"`
	}
	for _, bc := range []struct {
		name    string
		headers map[string]string
	}{
		{"no headers", nil},
		{"traceparent", map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				e := Event{AggregateType: "product", AggregateID: strconv.Itoa(i % 1000), Type: "product.updated",
					Payload: price{ProductID: int64(i % 1000), PriceCents: 1999}, Headers: bc.headers}
				if _, _, err := e.encode(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// Validation runs on every write: for a valid event it must not allocate.
func TestValidationDoesNotAllocate(t *testing.T) {
	headers := map[string]string{
		"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"tracestate":  "vendor=opaque-value",
	}
	payload := []byte(`{"product_id": 42, "name": "C:\\u0000 is a path, not a NUL"}`)
	// AllocsPerRun counts the whole process's allocations, and the
	// package's relay runs in the background (TestMain): the fewest of a
	// few measurements is validation's own.
	allocs := -1.0
	for range 5 {
		a := testing.AllocsPerRun(100, func() {
			if ValidEventType("product.updated") != nil || ValidateAggregate("product", "42") != nil ||
				ValidateHeaders(headers) != nil || ValidateHeaders(nil) != nil || hasNULEscape(payload) {
				t.Fatal("a valid event was refused")
			}
		})
		if allocs < 0 || a < allocs {
			allocs = a
		}
	}
	if allocs != 0 {
		t.Errorf("validating a valid event allocates %.0f times, want 0", allocs)
	}
}

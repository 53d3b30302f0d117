package cacheinval

import (
	"context"

	"github.com/fanout/fanout/shop"
)

// FillForTest exposes the conditional fill to the race test.
func FillForTest(ctx context.Context, c *Cache, p shop.Product) (bool, error) { return c.fill(ctx, p) }

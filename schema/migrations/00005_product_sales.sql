-- The sales ledger: units sold and revenue per product, kept by the
-- salesledger subscriber from order.created events. Each event adds its
-- order's lines, so the ledger is not idempotent by itself: only the
-- subscriber's checkpoint, written in the same transaction, keeps a
-- redelivered event from counting twice. That is why it exists: a second
-- handling of any event shows as a product whose ledger is more than the
-- sum of its order lines.

-- +goose Up
CREATE TABLE product_sales (
    -- No foreign key: a product deleted after it sold keeps its sales.
    product_id bigint        PRIMARY KEY,
    units      bigint        NOT NULL CHECK (units >= 0),
    revenue    numeric(16,2) NOT NULL CHECK (revenue >= 0),
    updated_at timestamptz   NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE product_sales;

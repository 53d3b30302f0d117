-- An order's life after it is placed: paid, shipped, delivered, or
-- cancelled on the way. Nothing follows delivered or cancelled. Each
-- transition is a row of order_transitions, written with its order.<status>
-- event in the writer's transaction: the order's history in SQL, which an
-- ordered subscriber (fulfilment) must reproduce from the events alone.

-- +goose Up
ALTER TABLE orders
    ADD COLUMN status text NOT NULL DEFAULT 'created'
        CHECK (status IN ('created', 'paid', 'shipped', 'delivered', 'cancelled'));

CREATE TABLE order_transitions (
    order_id    bigint      NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    -- 1 for the order's creation, then 2, 3, ... in commit order (the
    -- writers lock the order row).
    n           integer     NOT NULL CHECK (n >= 1),
    from_status text,
    to_status   text        NOT NULL,
    at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, n)
);

-- +goose Down
DROP TABLE order_transitions;
ALTER TABLE orders DROP COLUMN status;

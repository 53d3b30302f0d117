-- The fulfilment subscriber's own tables: each order's state and history as
-- it applied them from the order.* events, in order, and every event that
-- could not be applied in turn (out of order, after a gap, or after the
-- order ended). Its history must equal order_transitions, and its
-- violations must stay empty: that is the proof of the ordered runtime.

-- +goose Up
CREATE TABLE fulfilment_orders (
    order_id   bigint      PRIMARY KEY,
    status     text        NOT NULL,
    -- The number of transitions applied (1 after order.created).
    applied    integer     NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE fulfilment_history (
    order_id    bigint      NOT NULL,
    n           integer     NOT NULL,
    from_status text,
    to_status   text        NOT NULL,
    event_id    bigint      NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, n)
);

CREATE TABLE fulfilment_violations (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id    bigint      NOT NULL,
    event_id    bigint      NOT NULL,
    event_type  text        NOT NULL,
    reason      text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE fulfilment_violations;
DROP TABLE fulfilment_history;
DROP TABLE fulfilment_orders;

-- The demo shop whose writes the pipeline carries: a catalog (brands,
-- categories, products, inventory) and orders with their invoices.

-- +goose Up
CREATE TABLE brands (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name       text        NOT NULL UNIQUE,
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE categories (
    id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL UNIQUE
);

CREATE TABLE products (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    sku         text          NOT NULL UNIQUE,
    name        text          NOT NULL,
    description text          NOT NULL DEFAULT '',
    brand_id    bigint        NOT NULL REFERENCES brands (id),
    category_id bigint        NOT NULL REFERENCES categories (id),
    price       numeric(12,2) NOT NULL CHECK (price >= 0),
    rating      numeric(2,1)  NOT NULL DEFAULT 0 CHECK (rating BETWEEN 0 AND 5),
    ram_gb      integer       NOT NULL DEFAULT 0,
    storage_gb  integer       NOT NULL DEFAULT 0,
    -- Bumped by every change to anything in the product's search document
    -- (its row, its stock, its brand's name). Caches and the search index use
    -- it to refuse an older state over a newer one; outbox ids cannot serve,
    -- since they are allocated in one order and committed in another.
    version     bigint        NOT NULL DEFAULT 1,
    created_at  timestamptz   NOT NULL DEFAULT now(),
    updated_at  timestamptz   NOT NULL DEFAULT now()
);
CREATE INDEX products_brand_id_idx ON products (brand_id);
CREATE INDEX products_category_id_idx ON products (category_id);

CREATE TABLE inventory (
    product_id bigint      PRIMARY KEY REFERENCES products (id) ON DELETE CASCADE,
    stock      integer     NOT NULL CHECK (stock >= 0),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE orders (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- An order line snapshots what was sold (sku, name, price) when the order
-- was placed, so invoicing does not depend on the product still existing.
-- product_id has no foreign key on purpose: an order outlives the product it
-- names. sku and name are NULL only for lines written without a snapshot
-- (by hand, or by older writers); invoicing then needs the product row.
CREATE TABLE order_lines (
    order_id   bigint        NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    line_no    integer       NOT NULL,
    product_id bigint        NOT NULL,
    sku        text,
    name       text,
    quantity   integer       NOT NULL CHECK (quantity > 0),
    unit_price numeric(12,2) NOT NULL CHECK (unit_price >= 0),
    PRIMARY KEY (order_id, line_no)
);

-- Invoice numbers: INV-<year>-<8 digits>. A sequence, so concurrent
-- invoicing instances never collide (a rolled-back number is skipped).
CREATE SEQUENCE invoice_number_seq;

CREATE TABLE invoices (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- One invoice per order, whatever the subscriber does twice.
    order_id  bigint        NOT NULL UNIQUE REFERENCES orders (id),
    number    text          NOT NULL UNIQUE,
    total     numeric(14,2) NOT NULL,
    issued_at timestamptz   NOT NULL DEFAULT now()
);

CREATE TABLE invoice_lines (
    invoice_id  bigint        NOT NULL REFERENCES invoices (id) ON DELETE CASCADE,
    line_no     integer       NOT NULL,
    sku         text          NOT NULL,
    description text          NOT NULL,
    quantity    integer       NOT NULL,
    unit_price  numeric(12,2) NOT NULL,
    amount      numeric(14,2) NOT NULL,
    PRIMARY KEY (invoice_id, line_no)
);

-- +goose Down
DROP TABLE invoice_lines;
DROP TABLE invoices;
DROP SEQUENCE invoice_number_seq;
DROP TABLE order_lines;
DROP TABLE orders;
DROP TABLE inventory;
DROP TABLE products;
DROP TABLE categories;
DROP TABLE brands;

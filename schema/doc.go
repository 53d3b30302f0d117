// Package schema holds fanout's database schema as numbered, embedded SQL
// migrations, and applies them.
//
// Migrations run through goose with a Postgres advisory-lock session locker,
// so `fanout migrate` is safe to run twice and from several processes at once
// (every role's container may run it at start). Teams that own their
// migrations with other tooling use Print, which writes the same SQL.
package schema

//! Examples live in this package's `[[example]]` targets; see `orders.rs`. The orders
//! service they run is the library module [`orders`], which the crash harness in
//! `integration/` runs too (in a child process it kills).

pub mod orders;

pub mod guide;

pub mod metrics;

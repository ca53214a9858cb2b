//! Examples live in this package's `[[example]]` targets; see `orders.rs`.

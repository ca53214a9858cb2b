//! The durable inbox and outbox scenarios (`reliq_integration::stores`) on SQLite, one database file per test.

reliq_integration::store_tests!(reliq_integration::stores::Lite);

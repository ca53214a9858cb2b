//! The durable inbox and outbox scenarios (`reliq_integration::stores`) on the real PostgreSQL of `scripts/brokers` (`RELIQ_POSTGRES_URL`), one schema per test.

reliq_integration::store_tests!(reliq_integration::stores::Pg);

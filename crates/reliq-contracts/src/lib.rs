//! # reliq-contracts
//!
//! Message contracts for reliq's typed consumers and publishers
//! ([`Codec`](reliq_core::Codec), [`ConsumerBuilder::start_typed`](reliq_core::ConsumerBuilder::start_typed),
//! [`TypedPublisher`](reliq_core::TypedPublisher)):
//!
//! | format | plain codec | for a registry |
//! |---|---|---|
//! | JSON | [`JsonCodec`](reliq_core::JsonCodec) (reliq-core) | [`JsonSchema`] (JSON Schema from `schemars`) |
//! | Avro (feature `avro`) | [`Avro`] | [`Avro`] |
//! | Protobuf (feature `protobuf`) | [`Protobuf`] | [`Protobuf`] |
//!
//! [`RegistryCodec`] frames any of them in the schema-registry wire format (a magic
//! byte and the writer's schema id before the body, [`wire`]) against a
//! Confluent-compatible [`SchemaRegistry`] (Confluent's, Apicurio's `/apis/ccompat/v7`,
//! Karapace, Redpanda): schemas registered (or only looked up) under a subject named by
//! a [`SubjectStrategy`], writers' schemas fetched once per id, and a consumer's schema
//! checked against the subject's latest at start
//! ([`ConsumerBuilder::check_schema`](reliq_core::ConsumerBuilder::check_schema)).
//!
//! What does not decode is poison: parked at once with the decoder's reason, the
//! original bytes (and so the schema id) kept in the dead letter. A registry that does
//! not answer is transient: the message waits in the broker and comes back.
//!
//! ```no_run
//! # #[cfg(feature = "avro")]
//! # async fn f(broker: std::sync::Arc<dyn reliq_core::Broker>) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use reliq_contracts::{Avro, RegistryCodec, SchemaRegistry};
//! use reliq_core::{BoxError, Consumer, Delivery, StartupCheck};
//!
//! #[derive(serde::Serialize, serde::Deserialize, apache_avro::AvroSchema)]
//! struct OrderCreated { order: String, cents: i64 }
//!
//! let registry = Arc::new(SchemaRegistry::new("http://127.0.0.1:8081/apis/ccompat/v7")?);
//! let codec = RegistryCodec::new(Avro::<OrderCreated>::new(), registry);
//! let consumer = Consumer::builder(broker, "billing")
//!     .subscribe("orders")
//!     .check_schema(StartupCheck::Refuse)
//!     .start_typed(codec, |order: OrderCreated, _d: Delivery| async move {
//!         println!("{} for {} cents", order.order, order.cents);
//!         Ok::<(), BoxError>(())
//!     })
//!     .await?;
//! # consumer.shutdown().await; Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "avro")]
mod avro;
mod display;
mod framed;
mod json;
#[cfg(feature = "protobuf")]
mod protobuf;
mod registry;
pub mod wire;

#[cfg(feature = "avro")]
pub use avro::Avro;
pub use display::{Readable, ReencodeError, readable, reencoded};
pub use framed::{Registration, RegistryCodec, SchemaFormat};
pub use json::JsonSchema;
#[cfg(feature = "protobuf")]
pub use protobuf::Protobuf;
pub use registry::{RegisteredSchema, RegistryError, SchemaRegistry, SchemaType, SubjectStrategy};

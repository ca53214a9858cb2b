//! Typed payloads: a [`Codec`] turns a handler's type into payload bytes and back.
//!
//! The runtime stays bytes-in, bytes-out; a typed consumer
//! ([`ConsumerBuilder::start_typed`](crate::ConsumerBuilder::start_typed)) decodes each
//! delivery before its handler runs, and a payload that does not decode is **poison**:
//! parked at once with the decoder's reason, the original bytes kept in the dead letter.
//! A codec that needs a service to decode (a schema registry that did not answer) fails
//! [`CodecError::Unavailable`], which is **transient**: the message waits in the broker
//! and comes back, it is not parked for the registry's outage.
//!
//! [`JsonCodec`] lives here; Avro, Protobuf and the schema-registry wire format are in
//! `reliq-contracts`.

use std::marker::PhantomData;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::broker::Broker;
use crate::classify::{CodecError, DecodeError};
use crate::error::BrokerError;
use crate::headers;
use crate::message::{Message, MessageId};
use crate::subscription::Destination;

/// A message type's schema, as the codec knows it: what AsyncAPI's `payload` and
/// `schemaFormat` say, and what a registry stores.
#[derive(Clone, Debug, PartialEq)]
pub struct MessageSchema {
    /// The type's name (`OrderCreated`, `shop.OrderCreated`).
    pub name: String,
    /// AsyncAPI's `schemaFormat` (`application/schema+json;version=draft-07`,
    /// `application/vnd.apache.avro+json;version=1.9.0`,
    /// `application/vnd.google.protobuf;version=3`).
    pub format: String,
    /// The schema: a JSON document (JSON Schema, Avro), or a string (a `.proto` file).
    pub document: serde_json::Value,
}

/// Turns a `T` into payload bytes and back.
///
/// `encode` is told the destination's topic (a registry codec derives the schema's
/// subject from it); `decode` gets the payload alone (a registry-framed payload names its
/// writer's schema). Both may be asked concurrently from many tasks.
#[async_trait]
pub trait Codec<T>: Send + Sync + 'static
where
    T: Send + Sync + 'static,
{
    /// The `content-type` header a publish writes.
    fn content_type(&self) -> &str;

    /// The payload for `value`, to be published to `topic`.
    async fn encode(&self, value: &T, topic: &str) -> Result<Bytes, CodecError>;

    /// The value in `payload`.
    async fn decode(&self, payload: &[u8]) -> Result<T, CodecError>;

    /// The value in `payload` when it can be had without waiting (no registry round
    /// trip); `None` sends the caller to [`decode`](Self::decode). A typed consumer asks
    /// this first and builds `decode`'s boxed future only when it declines: a codec that
    /// never waits answers here and spares each message an allocation. Default: `None`.
    fn decode_now(&self, payload: &[u8]) -> Option<Result<T, CodecError>> {
        let _ = payload;
        None
    }

    /// The schema, when the codec has one (for AsyncAPI and the registry).
    fn schema(&self) -> Option<MessageSchema> {
        None
    }

    /// At a consumer's start: whether what the producers of `topic` write (the
    /// registry's latest schema for the topic's subject) can be read as `T`. `Ok(None)`:
    /// compatible, or nothing to check; `Ok(Some(why))`: incompatible, and why.
    async fn check_readable(&self, topic: &str) -> Result<Option<String>, CodecError> {
        let _ = topic;
        Ok(None)
    }
}

/// A message whose payload is `value` encoded by `codec` for `destination`, with a new
/// id and the codec's `content-type` header.
pub async fn encode_message<T: Send + Sync + 'static>(
    codec: &dyn Codec<T>,
    value: &T,
    destination: &Destination,
) -> Result<Message, CodecError> {
    let payload = codec.encode(value, &destination.topic).await?;
    Ok(Message::new(payload).with_header(headers::CONTENT_TYPE, codec.content_type()))
}

/// A typed publish failed: the value was not encoded, or the broker did not confirm it.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Encoding failed; nothing was published.
    #[error(transparent)]
    Encode(#[from] CodecError),
    /// The broker did not confirm the message.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// Publishes values of one type to one destination through a codec.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let broker: std::sync::Arc<dyn reliq_core::Broker> = std::sync::Arc::new(reliq_memory::MemoryBroker::new());
/// # let billing = reliq_core::Consumer::builder(broker.clone(), "billing").subscribe("orders")
/// #     .start(|_d| async { Ok::<(), reliq_core::BoxError>(()) }).await?;
/// use reliq_core::{Destination, JsonCodec, TypedPublisher};
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct OrderCreated { order: String, cents: u64 }
///
/// let orders = TypedPublisher::new(broker, Destination::new("orders"), JsonCodec::<OrderCreated>::new());
/// let order = OrderCreated { order: "o-1".into(), cents: 1250 };
/// // With a key and the event's own id (a producer's retry keeps it):
/// let message = orders.message(&order).await?.with_id("o-1").with_key("customer-7");
/// orders.publish_message(message).await?;
/// # billing.shutdown().await;
/// # Ok(()) }
/// ```
pub struct TypedPublisher<T> {
    broker: Arc<dyn Broker>,
    destination: Destination,
    codec: Arc<dyn Codec<T>>,
}

impl<T: Send + Sync + 'static> std::fmt::Debug for TypedPublisher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TypedPublisher")
            .field("broker", &self.broker.kind())
            .field("destination", &self.destination)
            .field("content_type", &self.codec.content_type())
            .finish()
    }
}

impl<T: Send + Sync + 'static> TypedPublisher<T> {
    /// Publish `T`s to `destination` on `broker`, encoded by `codec`.
    pub fn new(broker: Arc<dyn Broker>, destination: Destination, codec: impl Codec<T>) -> Self {
        Self {
            broker,
            destination,
            codec: Arc::new(codec),
        }
    }

    /// The message for `value` (a new id, the `content-type` header), to add a key, an
    /// id or headers before [`TypedPublisher::publish_message`].
    pub async fn message(&self, value: &T) -> Result<Message, CodecError> {
        encode_message(&*self.codec, value, &self.destination).await
    }

    /// Encode `value`, publish it and wait for the broker's confirm; returns its id.
    pub async fn publish(&self, value: &T) -> Result<MessageId, PublishError> {
        let message = self.message(value).await?;
        self.publish_message(message).await
    }

    /// Publish a message made by [`TypedPublisher::message`]; returns its id.
    pub async fn publish_message(&self, message: Message) -> Result<MessageId, PublishError> {
        let id = message.id().clone();
        self.broker.publish(&self.destination, message).await?;
        Ok(id)
    }

    /// The codec.
    pub fn codec(&self) -> &dyn Codec<T> {
        &*self.codec
    }
}

/// JSON through serde: what [`Delivery::json`](crate::Delivery::json) reads, as a codec.
/// A payload that is not JSON for `T` is poison with serde's reason, which names the
/// field (`missing field `cents``, `invalid type: string "x", expected u64`).
///
/// [`JsonCodec::with_schema`] adds the type's JSON Schema (`schemars`, feature
/// `json-schema`) for AsyncAPI and the registry.
pub struct JsonCodec<T> {
    schema: Option<MessageSchema>,
    _type: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for JsonCodec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonCodec")
            .field("type", &std::any::type_name::<T>())
            .field("schema", &self.schema.as_ref().map(|s| &s.name))
            .finish()
    }
}

impl<T> JsonCodec<T> {
    /// A JSON codec without a schema.
    pub fn new() -> Self {
        Self {
            schema: None,
            _type: PhantomData,
        }
    }

    /// A JSON codec that describes `T` by `schema` (a JSON Schema document named `name`).
    pub fn with_schema_document(name: impl Into<String>, schema: serde_json::Value) -> Self {
        Self {
            schema: Some(MessageSchema {
                name: name.into(),
                format: JSON_SCHEMA_FORMAT.into(),
                document: schema,
            }),
            _type: PhantomData,
        }
    }
}

impl<T> JsonCodec<T> {
    /// The schema it describes `T` by, if it was given one.
    pub fn schema_document(&self) -> Option<&MessageSchema> {
        self.schema.as_ref()
    }
}

/// AsyncAPI's `schemaFormat` for the JSON Schema documents reliq writes.
pub const JSON_SCHEMA_FORMAT: &str = "application/schema+json;version=draft-07";

/// AsyncAPI's `schemaFormat` for Avro schemas.
pub const AVRO_SCHEMA_FORMAT: &str = "application/vnd.apache.avro+json;version=1.9.0";

/// AsyncAPI's `schemaFormat` for Protobuf (proto3) files.
pub const PROTOBUF_SCHEMA_FORMAT: &str = "application/vnd.google.protobuf;version=3";

#[cfg(feature = "json-schema")]
impl<T: schemars::JsonSchema> JsonCodec<T> {
    /// A JSON codec that describes `T` by the JSON Schema `schemars` derives (draft-07,
    /// the dialect AsyncAPI 3.0 and the schema registries read).
    pub fn with_schema() -> Self {
        let generator = schemars::generate::SchemaSettings::draft07().into_generator();
        let schema = generator.into_root_schema_for::<T>();
        Self::with_schema_document(T::schema_name(), schema.to_value())
    }
}

impl<T> Default for JsonCodec<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl<T> Codec<T> for JsonCodec<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    fn content_type(&self) -> &str {
        "application/json"
    }

    async fn encode(&self, value: &T, _topic: &str) -> Result<Bytes, CodecError> {
        serde_json::to_vec(value)
            .map(Bytes::from)
            .map_err(|e| CodecError::Unencodable(e.to_string()))
    }

    async fn decode(&self, payload: &[u8]) -> Result<T, CodecError> {
        Ok(serde_json::from_slice(payload).map_err(DecodeError::Json)?)
    }

    fn decode_now(&self, payload: &[u8]) -> Option<Result<T, CodecError>> {
        Some(serde_json::from_slice(payload).map_err(|e| DecodeError::Json(e).into()))
    }

    fn schema(&self) -> Option<MessageSchema> {
        self.schema.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::BoxError;
    use crate::{Classifier, ErrorClass};

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Order {
        order: String,
        cents: u64,
    }

    #[tokio::test]
    async fn json_round_trip_and_poison_names_the_field() {
        let codec = JsonCodec::<Order>::new();
        let order = Order {
            order: "o-1".into(),
            cents: 1250,
        };
        let bytes = codec.encode(&order, "orders").await.unwrap();
        assert_eq!(codec.decode(&bytes).await.unwrap(), order);

        let err = codec.decode(br#"{"order":"o-2"}"#).await.unwrap_err();
        assert!(err.to_string().contains("missing field `cents`"), "{err}");
        let boxed: BoxError = Box::new(err);
        assert_eq!(
            Classifier::default().classify(boxed.as_ref()),
            ErrorClass::Poison
        );
    }

    #[test]
    fn codec_errors_classify_by_what_another_try_can_change() {
        let classifier = Classifier::default();
        let class = |e: CodecError| {
            let boxed: BoxError = Box::new(e);
            classifier.classify(boxed.as_ref())
        };
        assert_eq!(
            class(CodecError::undecodable("Avro", "bad varint")),
            ErrorClass::Poison
        );
        assert_eq!(
            class(CodecError::Unavailable {
                context: "registry".into(),
                source: None
            }),
            ErrorClass::Transient
        );
        assert_eq!(
            class(CodecError::Unencodable("x".into())),
            ErrorClass::Permanent
        );
    }
}

//! [`RegistryCodec`]: a schema format framed for a schema registry.

use std::marker::PhantomData;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use reliq_core::{Codec, CodecError, MessageSchema};

use crate::registry::{
    RegisteredSchema, RegistryError, SchemaRegistry, SchemaType, SubjectStrategy,
};
use crate::wire;

/// A payload format with a schema — Avro, Protobuf, JSON Schema — as a
/// [`RegistryCodec`] frames it. Each format is also a plain [`Codec`] (its bodies
/// without the registry's frame).
pub trait SchemaFormat<T>: Send + Sync + 'static {
    /// The registry's `schemaType` for it.
    fn schema_type(&self) -> SchemaType;
    /// The schema this side writes with, as the registry stores it.
    fn schema_text(&self) -> &str;
    /// The fully qualified name of the record or message type (the subject of the
    /// record-name strategies).
    fn record_name(&self) -> &str;
    /// The `content-type` header.
    fn content_type(&self) -> &'static str;
    /// The schema for AsyncAPI.
    fn message_schema(&self) -> MessageSchema;
    /// Append what follows the frame's header (Protobuf: the message indexes, then the
    /// body) for `value`.
    fn encode_body(&self, value: &T, out: &mut Vec<u8>) -> Result<(), CodecError>;
    /// Decode what followed the header, written with `writer`'s schema.
    fn decode_body(&self, rest: &[u8], writer: &RegisteredSchema) -> Result<T, CodecError>;
}

/// Whether a producer registers its schema or only looks it up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Registration {
    /// Register the schema on the first publish to a subject (Confluent's
    /// `auto.register.schemas=true`); the registry refuses an incompatible one.
    #[default]
    Register,
    /// Only look it up (`auto.register.schemas=false`): schemas are registered by a
    /// pipeline, and a publish with an unregistered schema fails (permanent).
    LookUp,
}

/// A codec for the schema-registry wire format: a magic byte, the writer's schema id,
/// then the body in `F` (see [`crate::wire`]).
///
/// - Publishing registers (or looks up) the schema under the subject the
///   [`SubjectStrategy`] names, once per subject: the id is cached.
/// - Consuming reads the writer's schema id from each payload and fetches that schema
///   once per id (ids never change). Avro resolves the writer's schema to the reader's.
///   A payload that is not framed, names an id the registry does not have, or does not
///   decode is poison (parked with the reason); a registry that does not answer is
///   transient (the message is retried).
/// - [`ConsumerBuilder::check_schema`](reliq_core::ConsumerBuilder::check_schema) asks
///   the registry whether this side's schema is compatible with the subject's latest.
pub struct RegistryCodec<T, F> {
    format: F,
    registry: Arc<SchemaRegistry>,
    strategy: SubjectStrategy,
    registration: Registration,
    _type: PhantomData<fn() -> T>,
}

impl<T, F> std::fmt::Debug for RegistryCodec<T, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryCodec")
            .field("type", &std::any::type_name::<T>())
            .field("registry", &self.registry)
            .field("strategy", &self.strategy)
            .field("registration", &self.registration)
            .finish_non_exhaustive()
    }
}

impl<T, F: SchemaFormat<T>> RegistryCodec<T, F> {
    /// `format` framed for `registry`, subjects named `<topic>-value`, schemas
    /// registered on first use.
    pub fn new(format: F, registry: Arc<SchemaRegistry>) -> Self {
        Self {
            format,
            registry,
            strategy: SubjectStrategy::default(),
            registration: Registration::default(),
            _type: PhantomData,
        }
    }

    /// How subjects are named.
    pub fn subject_strategy(mut self, strategy: SubjectStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Register schemas, or only look them up.
    pub fn registration(mut self, registration: Registration) -> Self {
        self.registration = registration;
        self
    }

    /// The subject this codec's schema has on `topic`.
    pub fn subject(&self, topic: &str) -> String {
        self.strategy.subject(topic, self.format.record_name())
    }

    /// The registry.
    pub fn registry(&self) -> &Arc<SchemaRegistry> {
        &self.registry
    }
}

#[async_trait]
impl<T, F> Codec<T> for RegistryCodec<T, F>
where
    T: Send + Sync + 'static,
    F: SchemaFormat<T>,
{
    fn content_type(&self) -> &str {
        self.format.content_type()
    }

    async fn encode(&self, value: &T, topic: &str) -> Result<Bytes, CodecError> {
        let subject = self.subject(topic);
        let (schema_type, text) = (self.format.schema_type(), self.format.schema_text());
        let id = match self.registration {
            Registration::Register => self.registry.register(&subject, schema_type, text).await,
            Registration::LookUp => self.registry.lookup(&subject, schema_type, text).await,
        }?;
        let mut out = Vec::with_capacity(64);
        wire::write_header(&mut out, id);
        self.format.encode_body(value, &mut out)?;
        Ok(Bytes::from(out))
    }

    async fn decode(&self, payload: &[u8]) -> Result<T, CodecError> {
        let framed = wire::read_header(payload)?;
        let writer = match self.registry.schema(framed.schema_id).await {
            Ok(writer) => writer,
            Err(RegistryError::NotFound(why)) => {
                return Err(CodecError::undecodable(
                    "schema-registry framing",
                    format!(
                        "the writer's schema id {} is not in the registry ({why})",
                        framed.schema_id
                    ),
                ));
            }
            Err(e) => return Err(e.into()),
        };
        self.decode_with(framed.rest, &writer)
    }

    /// Without waiting when the writer's schema is cached (the steady state: the
    /// registry is asked once per new schema id).
    fn decode_now(&self, payload: &[u8]) -> Option<Result<T, CodecError>> {
        let framed = match wire::read_header(payload) {
            Ok(framed) => framed,
            Err(e) => return Some(Err(e)),
        };
        let writer = self.registry.cached_schema(framed.schema_id)?;
        Some(self.decode_with(framed.rest, &writer))
    }

    fn schema(&self) -> Option<MessageSchema> {
        Some(self.format.message_schema())
    }

    async fn check_readable(&self, topic: &str) -> Result<Option<String>, CodecError> {
        let subject = self.subject(topic);
        let compatible = self
            .registry
            .is_compatible(
                &subject,
                self.format.schema_type(),
                self.format.schema_text(),
            )
            .await?;
        Ok((!compatible).then(|| {
            format!(
                "the registry finds {} incompatible with the latest schema of subject `{subject}` (at the subject's compatibility level)",
                self.format.record_name()
            )
        }))
    }
}

impl<T, F> RegistryCodec<T, F>
where
    T: Send + Sync + 'static,
    F: SchemaFormat<T>,
{
    /// The body after the framing, read with `writer`'s schema (which must be this
    /// codec's kind).
    fn decode_with(&self, rest: &[u8], writer: &RegisteredSchema) -> Result<T, CodecError> {
        if writer.schema_type != self.format.schema_type() {
            return Err(CodecError::undecodable(
                "schema-registry framing",
                format!(
                    "the writer's schema id {} is {:?}, this consumer reads {:?}",
                    writer.id,
                    writer.schema_type,
                    self.format.schema_type()
                ),
            ));
        }
        self.format.decode_body(rest, writer)
    }
}

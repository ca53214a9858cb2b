//! JSON with a JSON Schema, for the registry.

use std::marker::PhantomData;

use reliq_core::{Codec, CodecError, DecodeError, JsonCodec, MessageSchema};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::framed::SchemaFormat;
use crate::registry::{RegisteredSchema, SchemaType};

/// JSON bodies of a `T` described by its JSON Schema (`schemars`), as a registry's
/// `JSON` schema type. Unframed, use reliq-core's [`JsonCodec`]; this is its
/// registry side: [`RegistryCodec`](crate::RegistryCodec)`::new(JsonSchema::<T>::new(), registry)`.
/// A body that is not JSON for `T` is poison with serde's reason, which names the field.
pub struct JsonSchema<T> {
    schema: MessageSchema,
    text: String,
    _type: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for JsonSchema<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonSchema")
            .field("name", &self.schema.name)
            .finish_non_exhaustive()
    }
}

impl<T: schemars::JsonSchema> JsonSchema<T> {
    /// The format for `T`'s derived JSON Schema (draft-07).
    pub fn new() -> Self {
        let schema = JsonCodec::<T>::with_schema()
            .schema_document()
            .cloned()
            .unwrap_or_else(|| MessageSchema {
                name: T::schema_name().into(),
                format: reliq_core::JSON_SCHEMA_FORMAT.into(),
                document: serde_json::Value::Bool(true),
            });
        let text = schema.document.to_string();
        Self {
            schema,
            text,
            _type: PhantomData,
        }
    }
}

impl<T: schemars::JsonSchema> Default for JsonSchema<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> SchemaFormat<T> for JsonSchema<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    fn schema_type(&self) -> SchemaType {
        SchemaType::Json
    }

    fn schema_text(&self) -> &str {
        &self.text
    }

    fn record_name(&self) -> &str {
        &self.schema.name
    }

    fn content_type(&self) -> &'static str {
        "application/json"
    }

    fn message_schema(&self) -> MessageSchema {
        self.schema.clone()
    }

    fn encode_body(&self, value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        serde_json::to_writer(out, value).map_err(|e| CodecError::Unencodable(e.to_string()))
    }

    fn decode_body(&self, rest: &[u8], _writer: &RegisteredSchema) -> Result<T, CodecError> {
        Ok(serde_json::from_slice(rest).map_err(DecodeError::Json)?)
    }
}

/// Unframed, the same bytes as [`JsonCodec`], with the schema for AsyncAPI.
#[async_trait::async_trait]
impl<T> Codec<T> for JsonSchema<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    fn content_type(&self) -> &str {
        "application/json"
    }

    async fn encode(&self, value: &T, _topic: &str) -> Result<bytes::Bytes, CodecError> {
        let mut out = Vec::new();
        self.encode_body(value, &mut out)?;
        Ok(out.into())
    }

    async fn decode(&self, payload: &[u8]) -> Result<T, CodecError> {
        Ok(serde_json::from_slice(payload).map_err(DecodeError::Json)?)
    }

    fn decode_now(&self, payload: &[u8]) -> Option<Result<T, CodecError>> {
        Some(serde_json::from_slice(payload).map_err(|e| DecodeError::Json(e).into()))
    }

    fn schema(&self) -> Option<MessageSchema> {
        Some(self.schema.clone())
    }
}

//! Protobuf through `prost`.

use std::marker::PhantomData;

use async_trait::async_trait;
use bytes::Bytes;
use reliq_core::{Codec, CodecError, MessageSchema};

use crate::framed::SchemaFormat;
use crate::registry::{RegisteredSchema, SchemaType};
use crate::wire;

const FORMAT: &str = "Protobuf";

use reliq_core::PROTOBUF_SCHEMA_FORMAT;

/// Protobuf bodies of a `prost` message `T`.
///
/// prost's generated types do not carry their `.proto` source, which a registry stores:
/// give it (the file's text, usually `include_str!` of the file `prost-build` read) and
/// the message's fully qualified name. When the message is not the file's first, give
/// its index path too ([`Protobuf::message_index`]). A body that does not decode is
/// poison with prost's reason (which names the field).
pub struct Protobuf<T> {
    proto: String,
    name: String,
    indexes: Vec<i32>,
    _type: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for Protobuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Protobuf")
            .field("name", &self.name)
            .field("indexes", &self.indexes)
            .finish_non_exhaustive()
    }
}

impl<T> Protobuf<T> {
    /// The codec for message `full_name` (`shop.OrderCreated`), the first message of the
    /// file `proto`.
    pub fn new(proto: impl Into<String>, full_name: impl Into<String>) -> Self {
        Self {
            proto: proto.into(),
            name: full_name.into(),
            indexes: vec![0],
            _type: PhantomData,
        }
    }

    /// The message's index path in its file (`[1]`: the second top-level message;
    /// `[0, 2]`: the third message nested in the first). Written in each framed payload.
    pub fn message_index(mut self, indexes: Vec<i32>) -> Self {
        self.indexes = indexes;
        self
    }
}

impl<T: prost::Message + Default> Protobuf<T> {
    fn read(&self, body: &[u8]) -> Result<T, CodecError> {
        T::decode(body).map_err(|e| CodecError::undecodable(FORMAT, e))
    }
}

#[async_trait]
impl<T> Codec<T> for Protobuf<T>
where
    T: prost::Message + Default + Send + Sync + 'static,
{
    fn content_type(&self) -> &str {
        "application/x-protobuf"
    }

    async fn encode(&self, value: &T, _topic: &str) -> Result<Bytes, CodecError> {
        Ok(Bytes::from(value.encode_to_vec()))
    }

    async fn decode(&self, payload: &[u8]) -> Result<T, CodecError> {
        self.read(payload)
    }

    fn decode_now(&self, payload: &[u8]) -> Option<Result<T, CodecError>> {
        Some(self.read(payload))
    }

    fn schema(&self) -> Option<MessageSchema> {
        Some(self.message_schema())
    }
}

impl<T> SchemaFormat<T> for Protobuf<T>
where
    T: prost::Message + Default + Send + Sync + 'static,
{
    fn schema_type(&self) -> SchemaType {
        SchemaType::Protobuf
    }

    fn schema_text(&self) -> &str {
        &self.proto
    }

    fn record_name(&self) -> &str {
        &self.name
    }

    fn content_type(&self) -> &'static str {
        "application/x-protobuf"
    }

    fn message_schema(&self) -> MessageSchema {
        MessageSchema {
            name: self.name.clone(),
            format: PROTOBUF_SCHEMA_FORMAT.into(),
            document: serde_json::Value::String(self.proto.clone()),
        }
    }

    fn encode_body(&self, value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        wire::write_message_indexes(out, &self.indexes);
        value
            .encode(out)
            .map_err(|e| CodecError::Unencodable(format!("{}: {e}", self.name)))
    }

    fn decode_body(&self, rest: &[u8], writer: &RegisteredSchema) -> Result<T, CodecError> {
        let (indexes, body) = wire::read_message_indexes(rest)?;
        if indexes != self.indexes {
            return Err(CodecError::undecodable(
                FORMAT,
                format!(
                    "the payload holds the message at index path {indexes:?} of schema id {}, this consumer reads {} at {:?}",
                    writer.id, self.name, self.indexes
                ),
            ));
        }
        self.read(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct OrderCreated {
        #[prost(string, tag = "1")]
        order: String,
        #[prost(int64, tag = "2")]
        cents: i64,
    }

    const PROTO: &str = "syntax = \"proto3\";\npackage shop;\nmessage OrderCreated {\n  string order = 1;\n  int64 cents = 2;\n}\n";

    #[tokio::test]
    async fn round_trip_and_a_wrong_wire_type_names_the_field() {
        let codec = Protobuf::<OrderCreated>::new(PROTO, "shop.OrderCreated");
        let order = OrderCreated {
            order: "o-1".into(),
            cents: 1250,
        };
        let bytes = codec.encode(&order, "orders").await.unwrap();
        assert_eq!(codec.decode(&bytes).await.unwrap(), order);
        // Field 2 as a length-delimited string instead of a varint.
        let err = codec.decode(&[0x12, 0x01, b'x']).await.unwrap_err();
        assert!(matches!(err, CodecError::Undecodable(_)), "{err}");
        assert!(err.to_string().contains("cents"), "{err}");
    }
}

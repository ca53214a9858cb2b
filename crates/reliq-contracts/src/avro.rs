//! Avro through `apache-avro` and serde.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, RwLock};

use apache_avro::Schema;
use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::writer::datum::GenericDatumWriter;
use async_trait::async_trait;
use bytes::Bytes;
use reliq_core::{Codec, CodecError, MessageSchema};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::framed::SchemaFormat;
use crate::registry::{RegisteredSchema, SchemaType};

const FORMAT: &str = "Avro";

use reliq_core::AVRO_SCHEMA_FORMAT;

/// Avro binary bodies of a `T` (serde), written with one schema.
///
/// As a plain [`Codec`], a payload is one Avro datum, read with the same schema (both
/// sides agree on it out of band). Framed for a registry
/// ([`RegistryCodec`](crate::RegistryCodec)), each payload names its writer's schema and
/// the reader resolves it to its own (Avro schema resolution: fields added with
/// defaults, removed fields skipped, promotions), so producers and consumers evolve
/// apart. A datum that does not decode, or a writer's schema that cannot be resolved to
/// this one, is poison with apache-avro's reason.
///
/// ```
/// use reliq_contracts::Avro;
/// #[derive(serde::Serialize, serde::Deserialize, apache_avro::AvroSchema)]
/// struct OrderCreated { order: String, cents: i64 }
/// let avro = Avro::<OrderCreated>::new();
/// # let _ = avro;
/// ```
pub struct Avro<T> {
    schema: Schema,
    /// The schema's datum reader and writer, built once: the named types they resolve
    /// are not resolved again for every datum. `None` when they cannot be built (each
    /// datum then says why).
    prepared: Option<Prepared>,
    text: String,
    name: String,
    /// Writers' schemas met so far, by registry id (parsed once).
    writers: RwLock<HashMap<u32, Arc<Schema>>>,
    _type: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for Avro<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Avro")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<T: apache_avro::AvroSchema> Avro<T> {
    /// The codec for `T`'s derived schema (`#[derive(AvroSchema)]`).
    pub fn new() -> Self {
        Self::from_schema(T::get_schema())
    }
}

impl<T: apache_avro::AvroSchema> Default for Avro<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Avro<T> {
    /// The codec for a schema given as Avro JSON text; an invalid schema fails naming
    /// what the parser said.
    pub fn with_schema(text: &str) -> Result<Self, CodecError> {
        let schema = Schema::parse_str(text)
            .map_err(|e| CodecError::Unencodable(format!("invalid Avro schema: {e}")))?;
        Ok(Self::from_schema(schema))
    }

    fn from_schema(schema: Schema) -> Self {
        // The full JSON (defaults and docs kept: a registry's compatibility check needs
        // the defaults; the parsing canonical form drops them).
        let text = serde_json::to_string(&schema).unwrap_or_else(|_| schema.canonical_form());
        let name = schema
            .name()
            .map(|n| n.fullname(None))
            .unwrap_or_else(|| "value".to_owned());
        Self {
            prepared: Prepared::of(schema.clone()),
            schema,
            text,
            name,
            writers: RwLock::default(),
            _type: PhantomData,
        }
    }

    /// The schema this codec writes and reads with.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    fn writer_schema(&self, writer: &RegisteredSchema) -> Result<Arc<Schema>, CodecError> {
        if let Some(found) = self
            .writers
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&writer.id)
        {
            return Ok(found.clone());
        }
        let parsed = Arc::new(Schema::parse_str(&writer.schema).map_err(|e| {
            CodecError::undecodable(
                FORMAT,
                format!("the writer's schema id {} does not parse: {e}", writer.id),
            )
        })?);
        self.writers
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(writer.id, parsed.clone());
        Ok(parsed)
    }
}

/// A schema with its datum reader and writer, which borrow it.
#[ouroboros::self_referencing]
struct Prepared {
    schema: Schema,
    #[borrows(schema)]
    #[covariant]
    reader: GenericDatumReader<'this>,
    #[borrows(schema)]
    #[covariant]
    writer: GenericDatumWriter<'this>,
}

impl Prepared {
    fn of(schema: Schema) -> Option<Self> {
        PreparedTryBuilder {
            schema,
            reader_builder: |schema: &Schema| GenericDatumReader::builder(schema).build(),
            writer_builder: |schema: &Schema| GenericDatumWriter::builder(schema).build(),
        }
        .try_build()
        .ok()
    }
}

impl<T: Serialize> Avro<T> {
    fn write(&self, value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        let unencodable = |e: apache_avro::Error| {
            CodecError::Unencodable(format!("{} does not fit its Avro schema: {e}", self.name))
        };
        match &self.prepared {
            Some(prepared) => prepared.borrow_writer().write_ser(out, value).map(drop),
            None => GenericDatumWriter::builder(&self.schema)
                .build()
                .and_then(|writer| writer.write_ser(out, value))
                .map(drop),
        }
        .map_err(unencodable)
    }
}

impl<T: DeserializeOwned> Avro<T> {
    /// Read one datum written with `writer`'s schema: straight into `T` when it is this
    /// codec's own schema, else through Avro schema resolution to it.
    fn read(&self, mut body: &[u8], writer: &Schema) -> Result<T, CodecError> {
        let undecodable = |e: apache_avro::Error| CodecError::undecodable(FORMAT, e);
        // This codec's own schema (the plain codec, or a registry writer that is it):
        // the prepared reader, or one built for this datum.
        let own = std::ptr::eq(writer, &self.schema) || *writer == self.schema;
        let value = if own && let Some(prepared) = &self.prepared {
            prepared
                .borrow_reader()
                .read_deser(&mut body)
                .map_err(undecodable)?
        } else if own {
            GenericDatumReader::builder(writer)
                .build()
                .and_then(|reader| reader.read_deser(&mut body))
                .map_err(undecodable)?
        } else {
            let value = GenericDatumReader::builder(writer)
                .reader_schema(&self.schema)
                .build()
                .and_then(|reader| reader.read_value(&mut body))
                .map_err(undecodable)?;
            apache_avro::from_value(&value).map_err(undecodable)?
        };
        if !body.is_empty() {
            return Err(CodecError::undecodable(
                FORMAT,
                format!("{} bytes left after the datum", body.len()),
            ));
        }
        Ok(value)
    }
}

#[async_trait]
impl<T> Codec<T> for Avro<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    fn content_type(&self) -> &str {
        "application/vnd.apache.avro+binary"
    }

    async fn encode(&self, value: &T, _topic: &str) -> Result<Bytes, CodecError> {
        let mut out = Vec::with_capacity(64);
        self.write(value, &mut out)?;
        Ok(Bytes::from(out))
    }

    async fn decode(&self, payload: &[u8]) -> Result<T, CodecError> {
        self.read(payload, &self.schema)
    }

    fn decode_now(&self, payload: &[u8]) -> Option<Result<T, CodecError>> {
        Some(self.read(payload, &self.schema))
    }

    fn schema(&self) -> Option<MessageSchema> {
        Some(self.message_schema())
    }
}

impl<T> SchemaFormat<T> for Avro<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    fn schema_type(&self) -> SchemaType {
        SchemaType::Avro
    }

    fn schema_text(&self) -> &str {
        &self.text
    }

    fn record_name(&self) -> &str {
        &self.name
    }

    fn content_type(&self) -> &'static str {
        "application/vnd.apache.avro+binary"
    }

    fn message_schema(&self) -> MessageSchema {
        MessageSchema {
            name: self.name.clone(),
            format: AVRO_SCHEMA_FORMAT.into(),
            document: serde_json::from_str(&self.text).unwrap_or(serde_json::Value::Null),
        }
    }

    fn encode_body(&self, value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        self.write(value, out)
    }

    fn decode_body(&self, rest: &[u8], writer: &RegisteredSchema) -> Result<T, CodecError> {
        let writer = self.writer_schema(writer)?;
        self.read(rest, &writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema)]
    #[avro(namespace = "shop")]
    struct OrderCreated {
        order: String,
        cents: i64,
        note: Option<String>,
    }

    #[tokio::test]
    async fn round_trip_and_undecodable_bytes_are_poison_with_a_reason() {
        let avro = Avro::<OrderCreated>::new();
        assert_eq!(SchemaFormat::record_name(&avro), "shop.OrderCreated");
        let order = OrderCreated {
            order: "o-1".into(),
            cents: 1250,
            note: Some("gift".into()),
        };
        let bytes = avro.encode(&order, "orders").await.unwrap();
        assert_eq!(avro.decode(&bytes).await.unwrap(), order);
        let err = avro.decode(&[0xff, 0xff]).await.unwrap_err();
        assert!(matches!(err, CodecError::Undecodable(_)), "{err}");
        assert!(err.to_string().contains("Avro"), "{err}");
    }

    #[test]
    fn the_registered_text_keeps_defaults() {
        let avro = Avro::<()>::with_schema(
            r#"{"type":"record","name":"R","fields":[{"name":"a","type":"int","default":7}]}"#,
        )
        .unwrap();
        assert!(SchemaFormat::<()>::schema_text(&avro).contains("\"default\":7"));
        assert!(Avro::<()>::with_schema("{").is_err());
    }
}

//! Registry-framed payloads for people: decoded for what `reliq dlq show` and the console
//! print for a dead letter that names its writer's schema ([`readable`]), and a corrected
//! value written back in that same schema for an edit ([`reencoded`]).

use serde::Serialize;

use crate::registry::{RegistryError, SchemaRegistry, SchemaType};
use crate::wire;

/// A registry-framed payload, decoded with its writer's schema.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Readable {
    /// The writer's schema id (from the payload's header).
    pub schema_id: u32,
    /// The schema's kind.
    pub schema_type: SchemaType,
    /// The body as JSON, decoded with the writer's schema: an Avro datum, a JSON body, or
    /// a Protobuf message in its canonical JSON mapping (through the registry's `.proto`
    /// text; int64 fields as strings). `None` when it does not decode (see `note`).
    pub value: Option<serde_json::Value>,
    /// Why `value` is missing, when it is.
    pub note: Option<String>,
}

/// `payload` decoded with the writer's schema it names, for display. `Ok(None)`: the
/// payload is not registry-framed (no magic byte, too short). The schema is fetched once
/// per id ([`SchemaRegistry`]'s cache). A body that does not decode with its own schema
/// comes back with `value: None` and the decoder's reason in `note`: the dead letter is
/// still shown.
pub async fn readable(
    registry: &SchemaRegistry,
    payload: &[u8],
) -> Result<Option<Readable>, RegistryError> {
    let Ok(framed) = wire::read_header(payload) else {
        return Ok(None);
    };
    let writer = registry.schema(framed.schema_id).await?;
    let (value, note) = match writer.schema_type {
        SchemaType::Json => match serde_json::from_slice(framed.rest) {
            Ok(value) => (Some(value), None),
            Err(e) => (None, Some(format!("the body is not JSON: {e}"))),
        },
        SchemaType::Avro => avro_json(&writer.schema, framed.rest),
        SchemaType::Protobuf => match protobuf::to_json(&writer.schema, framed.rest) {
            Ok(value) => (Some(value), None),
            Err(e) => (None, Some(e)),
        },
    };
    Ok(Some(Readable {
        schema_id: framed.schema_id,
        schema_type: writer.schema_type,
        value,
        note,
    }))
}

/// Why a corrected value could not be written with its dead letter's schema.
#[derive(Debug, thiserror::Error)]
pub enum ReencodeError {
    /// The dead letter's payload names no schema.
    #[error(
        "the dead letter's payload is not in the schema registry's wire format (no magic byte \
         and schema id): send the corrected payload itself"
    )]
    NotFramed,
    /// A schema kind this build cannot write from JSON (Protobuf without the
    /// `protobuf` feature).
    #[error(
        "schema {schema_id} is {schema_type:?}, which this build of reliq-contracts cannot \
         re-encode (its `protobuf` feature is off): send the corrected payload as bytes"
    )]
    Unsupported {
        /// The writer's schema id.
        schema_id: u32,
        /// Its kind.
        schema_type: SchemaType,
    },
    /// The value is not a datum of the schema.
    #[error("the corrected value does not fit schema {schema_id}: {reason}")]
    Unfit {
        /// The writer's schema id.
        schema_id: u32,
        /// The encoder's reason (names the field where it does).
        reason: String,
    },
    /// The registry could not be asked for the schema.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// `value` (a corrected dead letter, as JSON) written with the schema `original` names:
/// the same magic byte and schema id, then an Avro datum of that schema or the JSON body
/// of a JSON Schema one — what an edit replays, so the consumer reads it with the schema
/// it already knows. A JSON Schema body is written as given: the consumer's decoder
/// checks it, and a body that still does not fit is parked again with its reason.
pub async fn reencoded(
    registry: &SchemaRegistry,
    original: &[u8],
    value: &serde_json::Value,
) -> Result<Vec<u8>, ReencodeError> {
    let framed = wire::read_header(original).map_err(|_| ReencodeError::NotFramed)?;
    let schema_id = framed.schema_id;
    let writer = registry.schema(schema_id).await?;
    let mut out = Vec::with_capacity(original.len() + 16);
    wire::write_header(&mut out, schema_id);
    match writer.schema_type {
        SchemaType::Json => {
            serde_json::to_writer(&mut out, value).map_err(|e| ReencodeError::Unfit {
                schema_id,
                reason: e.to_string(),
            })?
        }
        SchemaType::Avro => out.extend(
            avro_datum(&writer.schema, value)
                .map_err(|reason| ReencodeError::Unfit { schema_id, reason })?,
        ),
        SchemaType::Protobuf => match protobuf::from_json(&writer.schema, framed.rest, value) {
            Ok(body) => out.extend(body),
            Err(protobuf::Refused::Unfit(reason)) => {
                return Err(ReencodeError::Unfit { schema_id, reason });
            }
            Err(protobuf::Refused::Unsupported) => {
                return Err(ReencodeError::Unsupported {
                    schema_id,
                    schema_type: SchemaType::Protobuf,
                });
            }
        },
    }
    Ok(out)
}

/// A JSON value as an Avro datum of `schema`: JSON's objects, numbers and strings
/// resolved to the schema's records, ints, longs, floats, enums and unions.
#[cfg(feature = "avro")]
fn avro_datum(schema: &str, value: &serde_json::Value) -> Result<Vec<u8>, String> {
    let schema = apache_avro::Schema::parse_str(schema).map_err(|e| e.to_string())?;
    let datum = apache_avro::types::Value::try_from(value.clone())
        .and_then(|v| v.resolve(&schema))
        .map_err(|e| e.to_string())?;
    apache_avro::writer::datum::GenericDatumWriter::builder(&schema)
        .build()
        .and_then(|writer| writer.write_value_to_vec(datum))
        .map_err(|e| e.to_string())
}

#[cfg(not(feature = "avro"))]
fn avro_datum(_schema: &str, _value: &serde_json::Value) -> Result<Vec<u8>, String> {
    Err("reliq-contracts was built without its `avro` feature".to_owned())
}

/// Protobuf bodies through the registry's `.proto` text: parsed into descriptors
/// (protox-parse), the message the framing's indexes name, a dynamic message
/// (prost-reflect) to and from Protobuf's canonical JSON mapping.
#[cfg(feature = "protobuf")]
mod protobuf {
    use prost::Message as _;
    use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};

    use crate::wire;

    /// Why a corrected value could not be written.
    pub(super) enum Refused {
        Unfit(String),
        #[allow(dead_code)] // built only without the feature
        Unsupported,
    }

    /// The message at `indexes` (top-level index, then nested ones) of the `.proto` text.
    fn message(proto: &str, indexes: &[i32]) -> Result<MessageDescriptor, String> {
        let file = protox_parse::parse("registry.proto", proto)
            .map_err(|e| format!("the writer's .proto does not parse: {e}"))?;
        let mut pool = DescriptorPool::new();
        pool.add_file_descriptor_proto(file).map_err(|e| {
            format!("the writer's .proto does not resolve (imports are not fetched): {e}")
        })?;
        let file = pool
            .get_file_by_name("registry.proto")
            .ok_or_else(|| "the writer's .proto holds no file".to_owned())?;
        let missing = || format!("no message at index path {indexes:?} of the writer's .proto");
        let (first, nested) = indexes.split_first().ok_or_else(missing)?;
        let mut found = file
            .messages()
            .nth(usize::try_from(*first).map_err(|_| missing())?)
            .ok_or_else(missing)?;
        for index in nested {
            let index = usize::try_from(*index).map_err(|_| missing())?;
            let child = found.child_messages().nth(index);
            found = child.ok_or_else(missing)?;
        }
        Ok(found)
    }

    /// `rest` (message indexes, then the body) as JSON.
    pub(super) fn to_json(proto: &str, rest: &[u8]) -> Result<serde_json::Value, String> {
        let (indexes, body) = wire::read_message_indexes(rest).map_err(|e| e.to_string())?;
        let descriptor = message(proto, &indexes)?;
        let name = descriptor.full_name().to_owned();
        let decoded = DynamicMessage::decode(descriptor, body)
            .map_err(|e| format!("the Protobuf body does not decode as {name}: {e}"))?;
        serde_json::to_value(&decoded).map_err(|e| e.to_string())
    }

    /// `value` as the message the original's indexes (in `rest`) name: the indexes, then
    /// the body.
    pub(super) fn from_json(
        proto: &str,
        rest: &[u8],
        value: &serde_json::Value,
    ) -> Result<Vec<u8>, Refused> {
        let (indexes, _) =
            wire::read_message_indexes(rest).map_err(|e| Refused::Unfit(e.to_string()))?;
        let descriptor = message(proto, &indexes).map_err(Refused::Unfit)?;
        let corrected = DynamicMessage::deserialize(descriptor, value)
            .map_err(|e| Refused::Unfit(e.to_string()))?;
        let mut out = Vec::new();
        wire::write_message_indexes(&mut out, &indexes);
        corrected
            .encode(&mut out)
            .map_err(|e| Refused::Unfit(e.to_string()))?;
        Ok(out)
    }
}

#[cfg(not(feature = "protobuf"))]
mod protobuf {
    pub(super) enum Refused {
        #[allow(dead_code)] // built only with the feature
        Unfit(String),
        Unsupported,
    }

    pub(super) fn to_json(_proto: &str, _rest: &[u8]) -> Result<serde_json::Value, String> {
        Err("a Protobuf body: reliq-contracts was built without its `protobuf` feature".to_owned())
    }

    pub(super) fn from_json(
        _proto: &str,
        _rest: &[u8],
        _value: &serde_json::Value,
    ) -> Result<Vec<u8>, Refused> {
        Err(Refused::Unsupported)
    }
}

#[cfg(feature = "avro")]
fn avro_json(schema: &str, mut body: &[u8]) -> (Option<serde_json::Value>, Option<String>) {
    let decoded = apache_avro::Schema::parse_str(schema).and_then(|schema| {
        apache_avro::reader::datum::GenericDatumReader::builder(&schema)
            .build()
            .and_then(|reader| reader.read_value(&mut body))
    });
    match decoded.and_then(serde_json::Value::try_from) {
        Ok(value) => (Some(value), None),
        Err(e) => (None, Some(format!("the Avro body does not decode: {e}"))),
    }
}

#[cfg(not(feature = "avro"))]
fn avro_json(_schema: &str, _body: &[u8]) -> (Option<serde_json::Value>, Option<String>) {
    (
        None,
        Some("an Avro body: reliq-contracts was built without its `avro` feature".to_owned()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload that names no schema is refused before the registry is asked (its URL
    /// here answers nothing).
    #[tokio::test]
    async fn a_payload_without_the_wire_format_is_not_reencoded() {
        let registry = SchemaRegistry::new("http://127.0.0.1:9").expect("a registry client");
        let refused = reencoded(
            &registry,
            b"{\"order\":1}",
            &serde_json::json!({"order": 2}),
        )
        .await;
        assert!(
            matches!(refused, Err(ReencodeError::NotFramed)),
            "{refused:?}"
        );
        assert_eq!(registry.requests(), 0);
    }
}

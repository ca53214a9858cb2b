//! Registry-framed payloads decoded for people: what `reliq dlq show` and the console
//! print for a dead letter that names its writer's schema.

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
    /// The body as JSON: an Avro datum or a JSON body decoded with the writer's schema.
    /// `None` for Protobuf, whose `.proto` text the registry holds but which reliq does
    /// not interpret without the generated type.
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
        SchemaType::Protobuf => (
            None,
            Some("a Protobuf body: decode it with the message's generated type".to_owned()),
        ),
    };
    Ok(Some(Readable {
        schema_id: framed.schema_id,
        schema_type: writer.schema_type,
        value,
        note,
    }))
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

//! `reliq asyncapi`: a consumer's AsyncAPI document from its plan and a schema file.

use std::path::Path;

use reliq::{AsyncApi, MessageSchema};

use crate::args::{AsyncapiArgs, PayloadFormat};
use crate::{Failure, Reach, bad_input, connect_broker, failed};

/// AsyncAPI's `schemaFormat` of each language.
fn schema_format(format: PayloadFormat) -> &'static str {
    match format {
        PayloadFormat::JsonSchema => reliq::JSON_SCHEMA_FORMAT,
        PayloadFormat::Avro => reliq::AVRO_SCHEMA_FORMAT,
        PayloadFormat::Protobuf => reliq::PROTOBUF_SCHEMA_FORMAT,
    }
}

/// The schema file as a [`MessageSchema`]: its language from the flag or the extension,
/// its name from the flag, the schema's `title` / `name`, or `Message`.
fn payload_schema(
    path: &Path,
    format: Option<PayloadFormat>,
    name: Option<&str>,
) -> Result<MessageSchema, Failure> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad_input(format!("--payload-schema {}: {e}", path.display())))?;
    let format = format.unwrap_or_else(|| match path.extension().and_then(|e| e.to_str()) {
        Some("avsc") => PayloadFormat::Avro,
        Some("proto") => PayloadFormat::Protobuf,
        _ => PayloadFormat::JsonSchema,
    });
    let document = match format {
        PayloadFormat::Protobuf => serde_json::Value::String(text),
        _ => serde_json::from_str(&text).map_err(|e| {
            bad_input(format!(
                "--payload-schema {}: not a JSON document: {e}",
                path.display()
            ))
        })?,
    };
    let own_name = ["title", "name"]
        .iter()
        .find_map(|k| document.get(k).and_then(|v| v.as_str()));
    Ok(MessageSchema {
        name: name.or(own_name).unwrap_or("Message").to_owned(),
        format: schema_format(format).to_owned(),
        document,
    })
}

pub(crate) async fn asyncapi(args: AsyncapiArgs) -> Result<u8, Failure> {
    let payload = match &args.payload_schema {
        Some(path) => Some(payload_schema(
            path,
            args.payload_format,
            args.payload_name.as_deref(),
        )?),
        None => None,
    };
    let target = &args.subscription.target;
    let broker = connect_broker(&target.broker, Reach::Client).await?;
    let subscription = args.subscription.subscription();
    subscription
        .check_names()
        .map_err(|e| bad_input(e.to_string()))?;
    let plan = broker
        .plan(&subscription)
        .await
        .map_err(|e| failed(format!("planning: {}", reliq::ErrorChain(&e))))?;
    let title = args
        .title
        .clone()
        .unwrap_or_else(|| target.consumer.clone());
    let mut doc = AsyncApi::new(title, &args.service_version);
    if !args.no_servers {
        doc = doc.broker_url(&target.broker.url()?);
    }
    print!("{}", doc.consumer(plan, payload));
    Ok(0)
}

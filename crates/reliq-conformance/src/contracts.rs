//! Scenarios of typed consumers: each codec (JSON, Avro, Protobuf) round-trips a value
//! through the broker, and a payload that does not decode is parked as poison with the
//! decoder's reason and its bytes kept; a registry-framed dead letter is shown decoded
//! and corrected as its value.

use std::sync::{Arc, Mutex};

use anyhow::{Context, ensure};
use reliq_admin::{Dlq, EditRequest, SchemaView};
use reliq_contracts::{Avro, Protobuf, RegistryCodec, SchemaRegistry};
use reliq_core::{
    BoxError, Codec, DeadLetterReason, Delivery, Destination, JsonCodec, Message, TypedPublisher,
    seam::headers,
};

use crate::support::{Backend, Ctx, soon, wait_until};

/// An order as the three codecs carry it.
#[derive(
    Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema,
)]
#[avro(namespace = "shop")]
struct OrderCreated {
    order: String,
    cents: i64,
    note: Option<String>,
}

/// The same order as a prost message.
#[derive(Clone, PartialEq, prost::Message)]
struct OrderCreatedProto {
    #[prost(string, tag = "1")]
    order: String,
    #[prost(int64, tag = "2")]
    cents: i64,
}

const ORDER_PROTO: &str = "syntax = \"proto3\";\npackage shop;\nmessage OrderCreated {\n  string order = 1;\n  int64 cents = 2;\n}\n";

/// The typed handler's calls: each value with the delivery's `content-type`.
type Calls<T> = Arc<Mutex<Vec<(T, Option<String>)>>>;

/// One codec's case: `value` published through a [`TypedPublisher`] reaches the typed
/// handler equal, with the codec's `content-type`; `wrong` (a payload of another shape)
/// is dead-lettered as poison at its first attempt, its bytes kept, the reason naming
/// `reason_names`.
async fn typed_case<T, C>(
    b: &dyn Backend,
    name: &str,
    codec: impl Fn() -> C,
    value: T,
    wrong: &'static [u8],
    reason_names: &str,
) -> anyhow::Result<()>
where
    T: Clone + PartialEq + std::fmt::Debug + Send + Sync + 'static,
    C: Codec<T>,
{
    let ctx = Ctx::new(b, name).await?;
    let got: Calls<T> = Arc::default();
    let g = got.clone();
    let h = ctx
        .consumer("c")
        .start_typed(codec(), move |v: T, d: Delivery| {
            let g = g.clone();
            async move {
                let content_type = d.headers().get(headers::CONTENT_TYPE).map(str::to_owned);
                g.lock().expect("not poisoned").push((v, content_type));
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    let publisher = TypedPublisher::new(
        ctx.broker.clone(),
        Destination::new(ctx.topic.clone()),
        codec(),
    );
    let content_type = publisher.codec().content_type().to_owned();
    publisher
        .publish(&value)
        .await
        .with_context(|| format!("{name}: typed publish"))?;
    let wrong_message = Message::new(wrong);
    let wrong_id = wrong_message.id().clone();
    ctx.publish(wrong_message).await?;
    wait_until(
        &format!("{name}: the typed handler's call"),
        soon(b),
        || !got.lock().expect("not poisoned").is_empty(),
    )
    .await?;
    let dead = ctx.take_dead_letters("c", 1, soon(b)).await?;
    let (message, record) = &dead[0];
    ensure!(
        message.id() == &wrong_id,
        "{name}: the wrong payload is the one parked"
    );
    ensure!(
        record.reason == DeadLetterReason::Poison && record.attempts == 1,
        "{name}: parked as poison at once, got {:?} after {} attempts",
        record.reason,
        record.attempts
    );
    let error = record.error.clone().unwrap_or_default();
    ensure!(
        error.contains(reason_names),
        "{name}: the reason names `{reason_names}`: {error}"
    );
    ensure!(
        message.payload().as_ref() == wrong,
        "{name}: the parked payload is kept byte for byte"
    );
    let got = got.lock().expect("not poisoned").clone();
    ensure!(
        got == [(value, Some(content_type))],
        "{name}: one typed call with the value and the codec's content-type, got {got:?}"
    );
    h.shutdown().await;
    Ok(())
}

/// Typed consumers with JSON, Avro and Protobuf: the value round-trips through a typed
/// publish; a payload of another shape is poison with the decoder's reason.
pub async fn typed_codecs_round_trip_and_undecodable_is_poison(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let order = OrderCreated {
        order: "o-1".into(),
        cents: 1250,
        note: Some("gift wrap".into()),
    };
    typed_case(
        b,
        "typed-json",
        JsonCodec::<OrderCreated>::new,
        order.clone(),
        br#"{"order":"o-2","note":null}"#,
        "missing field `cents`",
    )
    .await?;
    // An Avro datum of a record whose first field is a long: read as the string's length
    // it runs past the end.
    typed_case(
        b,
        "typed-avro",
        Avro::<OrderCreated>::new,
        order,
        &[0x80, 0x80, 0x80, 0x80, 0x10, 0x02],
        "Avro",
    )
    .await?;
    // Field 2 (`cents`) sent length-delimited instead of as a varint.
    typed_case(
        b,
        "typed-protobuf",
        || Protobuf::<OrderCreatedProto>::new(ORDER_PROTO, "shop.OrderCreated"),
        OrderCreatedProto {
            order: "o-1".into(),
            cents: 1250,
        },
        &[0x0a, 0x01, b'x', 0x12, 0x01, b'x'],
        "cents",
    )
    .await?;
    Ok(())
}

/// One codec's registry-framed dead letter: `parked` (over the limit) is dead-lettered
/// as permanent; `show` decodes it to `decoded`; an edit with `correction` is written back
/// with the same schema and the typed consumer reads `corrected`.
#[allow(clippy::too_many_arguments)]
async fn registry_case<T, F>(
    b: &dyn Backend,
    name: &str,
    codec: impl Fn() -> RegistryCodec<T, F>,
    cents: fn(&T) -> i64,
    parked: T,
    decoded: serde_json::Value,
    correction: serde_json::Value,
    corrected: T,
) -> anyhow::Result<()>
where
    T: Clone + PartialEq + std::fmt::Debug + Send + Sync + 'static,
    F: reliq_contracts::SchemaFormat<T>,
{
    let ctx = Ctx::new(b, name).await?;
    let handled: Arc<Mutex<Vec<T>>> = Arc::default();
    let seen = handled.clone();
    let h = ctx
        .consumer("c")
        .start_typed(codec(), move |order: T, _d: Delivery| {
            let seen = seen.clone();
            async move {
                if cents(&order) > 1000 {
                    return Err::<(), BoxError>(
                        reliq_core::Permanent::msg("the order is over the limit").into(),
                    );
                }
                seen.lock().expect("not poisoned").push(order);
                Ok(())
            }
        })
        .await?;
    let id = TypedPublisher::new(
        ctx.broker.clone(),
        Destination::new(ctx.topic.clone()),
        codec(),
    )
    .publish(&parked)
    .await?;
    wait_until(&format!("{name}: the order parked"), soon(b), || {
        h.stats().dead_lettered == 1
    })
    .await?;
    let registry = codec().registry().clone();
    let dlq = Dlq::new(ctx.broker.clone(), ctx.subscription("c"))?.with_schema_registry(registry);
    let shown = dlq.show(id.as_str()).await?;
    let value = match &shown.schema {
        Some(SchemaView::Decoded(readable)) => readable.value.clone(),
        other => anyhow::bail!("{name}: the dead letter is not shown decoded: {other:?}"),
    };
    ensure!(
        value == Some(decoded),
        "{name}: decoded with the writer's schema: {value:?}"
    );
    let edit = EditRequest {
        value: Some(correction),
        ..EditRequest::default()
    };
    dlq.edit(id.as_str(), &edit).await?;
    wait_until(
        &format!("{name}: the corrected order handled"),
        soon(b),
        || !handled.lock().expect("not poisoned").is_empty(),
    )
    .await?;
    let got = handled.lock().expect("not poisoned").clone();
    ensure!(
        got == [corrected],
        "{name}: the corrected copy, read with the same schema: {got:?}"
    );
    h.shutdown().await;
    Ok(())
}

/// A registry-framed order (the real registry) in Avro and in Protobuf, parked as
/// permanent: the operator's `show` decodes it with its writer's schema (Protobuf through
/// the registry's `.proto` text, in its canonical JSON mapping: int64 as a string), and an
/// `edit` with a corrected value writes it back with that schema — the typed consumer
/// reads the replayed copy.
pub async fn registry_framed_dead_letter_is_shown_decoded_and_corrected(
    b: &dyn Backend,
) -> anyhow::Result<()> {
    let registry = Arc::new(SchemaRegistry::new(&b.schema_registry())?);
    let order = |cents, note: Option<&str>| OrderCreated {
        order: "o-7".into(),
        cents,
        note: note.map(str::to_owned),
    };
    registry_case(
        b,
        "typed-registry-avro",
        || RegistryCodec::new(Avro::<OrderCreated>::new(), registry.clone()),
        |o| o.cents,
        order(1250, None),
        serde_json::json!({ "order": "o-7", "cents": 1250, "note": null }),
        serde_json::json!({ "order": "o-7", "cents": 990, "note": "split" }),
        order(990, Some("split")),
    )
    .await?;
    let proto = |cents| OrderCreatedProto {
        order: "o-7".into(),
        cents,
    };
    registry_case(
        b,
        "typed-registry-protobuf",
        || {
            RegistryCodec::new(
                Protobuf::<OrderCreatedProto>::new(ORDER_PROTO, "shop.OrderCreated"),
                registry.clone(),
            )
        },
        |o| o.cents,
        proto(1250),
        serde_json::json!({ "order": "o-7", "cents": "1250" }),
        serde_json::json!({ "order": "o-7", "cents": 990 }),
        proto(990),
    )
    .await
}

//! Typed consumers against the real schema registry `scripts/brokers` starts (Apicurio
//! Registry's Confluent-compatible API, `RELIQ_SCHEMA_REGISTRY_URL`): registration and
//! the subject strategies, the caches that keep the registry off the steady-state path,
//! the start-up compatibility check, and Avro schema evolution through the wire format
//! on the embedded broker and on Kafka.

use std::sync::{Arc, Mutex};

use anyhow::{Context, bail, ensure};
use reliq_conformance::support::{soon, unique, wait_until};
use reliq_conformance::{Backend, Ctx};
use reliq_contracts::{
    Avro, JsonSchema, Protobuf, Registration, RegistryCodec, SchemaRegistry, SchemaType,
    SubjectStrategy, wire,
};
use reliq_core::{
    BoxError, Codec, CodecError, Consumer, ConsumerError, DeadLetterReason, Delivery, Destination,
    Message, StartupCheck, TypedPublisher,
};
use reliq_integration::kafka::KafkaBackend;
use reliq_integration::memory::MemoryBackend;

fn registry() -> anyhow::Result<Arc<SchemaRegistry>> {
    let url = reliq_integration::settings::get("RELIQ_SCHEMA_REGISTRY_URL");
    Ok(Arc::new(SchemaRegistry::new(&url)?))
}

/// Version 1 of the order event.
#[derive(
    Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema,
)]
#[avro(namespace = "shop")]
#[serde(rename = "OrderCreated")]
struct OrderV1 {
    order: String,
    cents: i64,
}

/// Version 2: a field added with a default (a backward-compatible evolution).
#[derive(
    Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema,
)]
#[avro(namespace = "shop")]
#[serde(rename = "OrderCreated")]
struct OrderV2 {
    order: String,
    cents: i64,
    #[avro(default = "\"none\"")]
    currency: String,
}

/// `cents` as a string: not readable from what version 1 wrote.
#[derive(
    Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema,
)]
#[avro(namespace = "shop")]
#[serde(rename = "OrderCreated")]
struct OrderCentsAsText {
    order: String,
    cents: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct OrderProto {
    #[prost(string, tag = "1")]
    order: String,
    #[prost(int64, tag = "2")]
    cents: i64,
}
const ORDER_PROTO: &str = "syntax = \"proto3\";\npackage shop;\nmessage Order {\n  string order = 1;\n  int64 cents = 2;\n}\n";

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
struct OrderJson {
    order: String,
    cents: i64,
}

/// Each strategy names the subject as Confluent's serializers do; the framed id is the
/// registered one and reads back by id with its type; the same schema registers once.
#[tokio::test]
async fn register_and_look_up_by_id_under_each_subject_strategy() -> anyhow::Result<()> {
    let registry = registry()?;
    let topic = unique("contracts-strategy");
    for (strategy, subject) in [
        (SubjectStrategy::TopicName, format!("{topic}-value")),
        (SubjectStrategy::RecordName, "shop.OrderCreated".to_owned()),
        (
            SubjectStrategy::TopicRecordName,
            format!("{topic}-shop.OrderCreated"),
        ),
    ] {
        let codec =
            RegistryCodec::new(Avro::<OrderV1>::new(), registry.clone()).subject_strategy(strategy);
        ensure!(codec.subject(&topic) == subject, "{strategy:?}");
        let order = OrderV1 {
            order: "o-1".into(),
            cents: 1250,
        };
        let bytes = codec.encode(&order, &topic).await?;
        let framed = wire::read_header(&bytes)?;
        let latest = registry.latest(&subject).await?;
        ensure!(
            latest.id == framed.schema_id,
            "{strategy:?}: the payload names the id registered under `{subject}`"
        );
        let by_id = registry.schema(framed.schema_id).await?;
        ensure!(by_id.schema_type == SchemaType::Avro && by_id.schema.contains("cents"));
        ensure!(codec.decode(&bytes).await? == order);
    }
    // Protobuf and JSON Schema register as their own types (each on a topic of its own:
    // a subject holds one type).
    let proto_topic = unique("contracts-proto");
    let proto = RegistryCodec::new(
        Protobuf::<OrderProto>::new(ORDER_PROTO, "shop.Order"),
        registry.clone(),
    );
    let bytes = proto
        .encode(
            &OrderProto {
                order: "o-2".into(),
                cents: 5,
            },
            &proto_topic,
        )
        .await?;
    let id = wire::read_header(&bytes)?.schema_id;
    ensure!(registry.schema(id).await?.schema_type == SchemaType::Protobuf);
    ensure!(proto.decode(&bytes).await?.cents == 5);
    let json_topic = unique("contracts-json");
    let json = RegistryCodec::new(JsonSchema::<OrderJson>::new(), registry.clone());
    let bytes = json
        .encode(
            &OrderJson {
                order: "o-3".into(),
                cents: 7,
            },
            &json_topic,
        )
        .await?;
    let id = wire::read_header(&bytes)?.schema_id;
    ensure!(registry.schema(id).await?.schema_type == SchemaType::Json);
    ensure!(json.decode(&bytes).await?.cents == 7);
    Ok(())
}

/// Look-up only: a publish with a schema nobody registered fails, permanently (a retry
/// cannot register it); once registered, the same codec finds it.
#[tokio::test]
async fn look_up_only_refuses_an_unregistered_schema() -> anyhow::Result<()> {
    let registry = registry()?;
    let topic = unique("contracts-lookup");
    let lookup = RegistryCodec::new(Avro::<OrderV1>::new(), registry.clone())
        .registration(Registration::LookUp);
    let order = OrderV1 {
        order: "o-1".into(),
        cents: 1,
    };
    match lookup.encode(&order, &topic).await {
        Err(CodecError::Unencodable(why)) => ensure!(why.contains(&topic), "{why}"),
        other => bail!("expected a permanent refusal naming the subject, got {other:?}"),
    }
    RegistryCodec::new(Avro::<OrderV1>::new(), registry.clone())
        .encode(&order, &topic)
        .await?;
    lookup.encode(&order, &topic).await?;
    Ok(())
}

/// The registry is asked once per schema id, not once per message: a producer registers
/// once per subject, a consumer fetches each writer's schema once.
#[tokio::test]
async fn the_cache_asks_the_registry_once_per_new_schema_id() -> anyhow::Result<()> {
    let topic = unique("contracts-cache");
    let producer_registry = registry()?;
    let v1 = RegistryCodec::new(Avro::<OrderV1>::new(), producer_registry.clone());
    let v2 = RegistryCodec::new(Avro::<OrderV2>::new(), producer_registry.clone());
    let mut payloads = Vec::new();
    for n in 0..200 {
        let order = OrderV1 {
            order: format!("o-{n}"),
            cents: n,
        };
        payloads.push(v1.encode(&order, &topic).await?);
    }
    ensure!(
        producer_registry.requests() == 1,
        "200 publishes of one schema: {} registry requests",
        producer_registry.requests()
    );
    for n in 0..200 {
        let order = OrderV2 {
            order: format!("o-{n}"),
            cents: n,
            currency: "EUR".into(),
        };
        payloads.push(v2.encode(&order, &topic).await?);
    }
    ensure!(producer_registry.requests() == 2);

    let consumer_registry = registry()?;
    let reader = RegistryCodec::new(Avro::<OrderV2>::new(), consumer_registry.clone());
    for (n, payload) in payloads.iter().enumerate() {
        let order = reader.decode(payload).await?;
        let expected_currency = if n < 200 { "none" } else { "EUR" };
        ensure!(
            order.currency == expected_currency,
            "payload {n}: {order:?} (version 1's resolved with the default)"
        );
    }
    ensure!(
        consumer_registry.requests() == 2,
        "400 payloads of two writer schemas: {} registry requests",
        consumer_registry.requests()
    );
    Ok(())
}

/// At start, a consumer whose type cannot read what the producers registered is refused
/// with `Refuse` (naming the topic) and started with `Warn`, which logs why; a compatible
/// evolution starts with `Refuse`.
#[tokio::test]
async fn an_incompatible_consumer_is_refused_at_start_or_warned() -> anyhow::Result<()> {
    let log = reliq_conformance::support::captured_log()?;
    let registry = registry()?;
    let backend = MemoryBackend::new();
    let broker = backend.connect().await?;
    let topic = unique("contracts-compat");
    RegistryCodec::new(Avro::<OrderV1>::new(), registry.clone())
        .encode(
            &OrderV1 {
                order: "o-1".into(),
                cents: 1,
            },
            &topic,
        )
        .await?;
    let handler = |_: OrderCentsAsText, _: Delivery| async { Ok::<(), BoxError>(()) };
    let refused = Consumer::builder(broker.clone(), "compat-refuse")
        .subscribe(&topic)
        .check_schema(StartupCheck::Refuse)
        .start_typed(
            RegistryCodec::new(Avro::<OrderCentsAsText>::new(), registry.clone()),
            handler,
        )
        .await;
    match refused {
        Err(ConsumerError::Schema { topic: t, reason }) => {
            ensure!(
                t == topic && reason.contains(&format!("{topic}-value")),
                "{reason}"
            )
        }
        Err(other) => bail!("refused for another reason: {other}"),
        Ok(h) => {
            h.shutdown().await;
            bail!("an incompatible consumer started with StartupCheck::Refuse")
        }
    }
    let warned = Consumer::builder(broker.clone(), "compat-warn")
        .subscribe(&topic)
        .check_schema(StartupCheck::Warn)
        .start_typed(
            RegistryCodec::new(Avro::<OrderCentsAsText>::new(), registry.clone()),
            handler,
        )
        .await
        .context("Warn starts an incompatible consumer")?;
    warned.shutdown().await;
    let said: Vec<String> = log
        .warnings()
        .into_iter()
        .filter(|l| l.contains("compat-warn"))
        .collect();
    ensure!(
        said.len() == 1
            && said[0].contains("cannot be read by this consumer")
            && said[0].contains(&format!("{topic}-value")),
        "Warn logs the incompatibility once, naming the subject: {said:?}"
    );
    let compatible = Consumer::builder(broker, "compat-ok")
        .subscribe(&topic)
        .check_schema(StartupCheck::Refuse)
        .start_typed(
            RegistryCodec::new(Avro::<OrderV2>::new(), registry.clone()),
            |_: OrderV2, _: Delivery| async { Ok::<(), BoxError>(()) },
        )
        .await
        .context("a compatible evolution starts with Refuse")?;
    compatible.shutdown().await;
    Ok(())
}

/// A producer on version 1, a consumer on version 2: every order arrives, resolved with
/// the default; an unframed payload and one naming an id the registry does not have are
/// parked as poison with the reason, their bytes kept.
async fn evolution_through_the_broker(b: &dyn Backend) -> anyhow::Result<()> {
    let registry = registry()?;
    let ctx = Ctx::new(b, "contracts-evolution").await?;
    let got: Arc<Mutex<Vec<OrderV2>>> = Arc::default();
    let g = got.clone();
    let h = ctx
        .consumer("c")
        .start_typed(
            RegistryCodec::new(Avro::<OrderV2>::new(), registry.clone()),
            move |order: OrderV2, _d: Delivery| {
                let g = g.clone();
                async move {
                    g.lock().expect("not poisoned").push(order);
                    Ok::<(), BoxError>(())
                }
            },
        )
        .await?;
    let producer = TypedPublisher::new(
        ctx.broker.clone(),
        Destination::new(ctx.topic.clone()),
        RegistryCodec::new(Avro::<OrderV1>::new(), registry.clone()),
    );
    for n in 0..20 {
        producer
            .publish(&OrderV1 {
                order: format!("o-{n}"),
                cents: n,
            })
            .await?;
    }
    let unframed = Message::new(&b"{\"order\":\"o-x\"}"[..]);
    let unknown_id = Message::new(&[0u8, 0x7f, 0xff, 0xff, 0xff, 0x02][..]);
    let poison_ids = [unframed.id().clone(), unknown_id.id().clone()];
    ctx.publish_all(vec![unframed, unknown_id]).await?;
    wait_until("20 typed orders", soon(b), || {
        got.lock().expect("not poisoned").len() >= 20
    })
    .await?;
    let dead = ctx.take_dead_letters("c", 2, soon(b)).await?;
    for (message, record) in &dead {
        ensure!(poison_ids.contains(message.id()));
        ensure!(record.reason == DeadLetterReason::Poison && record.attempts == 1);
        let error = record.error.clone().unwrap_or_default();
        let expected = if message.payload().first() == Some(&0) {
            "schema id 2147483647 is not in the registry"
        } else {
            "not the magic byte"
        };
        ensure!(
            error.contains(expected),
            "reason `{error}` lacks `{expected}`"
        );
    }
    let got = got.lock().expect("not poisoned").clone();
    ensure!(got.len() == 20, "each order once: {}", got.len());
    ensure!(got.iter().all(|o| o.currency == "none"));
    h.shutdown().await;
    Ok(())
}

/// The conformance scenario of a registry-framed dead letter on the embedded broker, on
/// the real clock (its conformance suite runs on a paused one, which the registry
/// client's timeouts cannot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_framed_dead_letter_is_shown_decoded_and_corrected_on_memory() -> anyhow::Result<()>
{
    reliq_conformance::registry_framed_dead_letter_is_shown_decoded_and_corrected(
        &MemoryBackend::new(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_evolution_through_the_registry_on_memory() -> anyhow::Result<()> {
    evolution_through_the_broker(&MemoryBackend::new()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_evolution_through_the_registry_on_kafka() -> anyhow::Result<()> {
    evolution_through_the_broker(&KafkaBackend::new()).await
}

/// The orders example's AsyncAPI document on every backend has the failure path — the
/// source, each retry channel where the broker has one (else retries are said to wait in
/// the source), the dead-letter channel whose message is reliq's dead-letter record — and
/// is exactly what docs/asyncapi/orders.<backend>.json holds (`just lint` validates those
/// files with the AsyncAPI parser). `RELIQ_WRITE_ASYNCAPI=1` rewrites the files instead.
#[tokio::test]
async fn the_orders_asyncapi_document_has_the_failure_path_on_every_backend() -> anyhow::Result<()>
{
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/asyncapi");
    let write = std::env::var_os("RELIQ_WRITE_ASYNCAPI").is_some();
    for backend in ["memory", "kafka", "rabbit", "nats", "sqs"] {
        let broker = reliq_integration::connect_by_name(backend).await?;
        let doc = reliq_examples::orders::asyncapi(broker, "orders").await?;
        let json = doc.to_json();
        let channels = json["channels"].as_object().context("channels")?;
        // The source and its message: the example's event, with its JSON Schema.
        let source = &channels["orders"];
        ensure!(
            source["messages"]["OrderCreated"].is_object(),
            "{backend}: {source}"
        );
        let event = &json["components"]["messages"]["OrderCreated"];
        ensure!(
            event["payload"]["schema"]["properties"]["data"].is_object(),
            "{backend}: the payload's schema is the envelope's: {event}"
        );
        // The dead-letter channel holds the dead-letter record.
        let dlq = &channels["orders_inventory_dlq"];
        ensure!(
            dlq["messages"]["OrderCreated_deadLetter"]["$ref"]
                == "#/components/messages/OrderCreated_deadLetter",
            "{backend}: {dlq}"
        );
        let dead = &json["components"]["messages"]["OrderCreated_deadLetter"];
        ensure!(dead["headers"]["$ref"] == "#/components/schemas/reliqDeadLetterHeaders");
        ensure!(
            dead["payload"] == event["payload"],
            "{backend}: a dead letter keeps the payload"
        );
        let record = &json["components"]["schemas"]["reliqDeadLetterHeaders"];
        for header in [
            "reliq-dead-letter-reason",
            "reliq-error-class",
            "reliq-attempt",
            "reliq-dead-lettered-at",
            "reliq-first-failure-at",
            "reliq-original-destination",
        ] {
            ensure!(
                record["properties"][header].is_object(),
                "{backend}: {header}"
            );
        }
        ensure!(
            record["properties"]["reliq-dead-letter-reason"]["enum"]
                .as_array()
                .is_some_and(|r| r.len() == DeadLetterReason::ALL.len()),
            "{backend}: every reason"
        );
        // The replay marker headers on the source's message.
        let headers = &json["components"]["schemas"]["reliqHeaders"]["properties"];
        ensure!(
            headers["reliq-replay-count"].is_object() && headers["reliq-replayed-at"].is_object()
        );
        // Retry channels: a topic / TTL queue per tier on Kafka and RabbitMQ, the source
        // stream's schedule subjects on NATS, none where retries wait in the source.
        let retries: Vec<&String> = channels.keys().filter(|k| k.contains("retry")).collect();
        let receive = &json["operations"]["inventory_receive"];
        match backend {
            "kafka" | "rabbit" => {
                ensure!(
                    retries
                        == [
                            "orders_inventory_retry_200ms",
                            "orders_inventory_retry_500ms"
                        ],
                    "{backend}: {retries:?}"
                );
                ensure!(
                    receive["x-reliq-retries"]["tiers"] == serde_json::json!(["200ms", "500ms"])
                );
            }
            "nats" => {
                ensure!(retries == ["orders_inventory_retry"], "{retries:?}");
                ensure!(
                    channels["orders_inventory_retry"]["address"] == "retry.orders.inventory.at.*"
                );
            }
            _ => {
                ensure!(retries.is_empty(), "{backend}: {retries:?}");
                ensure!(
                    receive["x-reliq-retries"]["waitIn"] == "source",
                    "{backend}: {receive}"
                );
            }
        }
        // The broker's bindings.
        let binding = match backend {
            "kafka" => {
                source["bindings"]["kafka"]["topic"] == "orders"
                    && receive["bindings"]["kafka"]["groupId"]["const"] == "inventory"
            }
            "rabbit" => source["bindings"]["amqp"]["exchange"]["name"] == "orders",
            "sqs" => {
                source["bindings"]["sqs"]["queue"]["redrivePolicy"]["deadLetterQueue"]["name"]
                    == "orders_inventory_dlq"
            }
            _ => true,
        };
        ensure!(binding, "{backend}: {source}");
        let file = docs.join(format!("orders.{backend}.json"));
        let text = doc.to_string();
        same_as_committed(&file, &text, write)?;
    }
    // An Avro payload (the schema in its own format, for the parser's Avro schema parser).
    let broker = reliq_integration::connect_by_name("kafka").await?;
    let doc = Consumer::builder(broker, "billing")
        .subscribe("orders")
        .retry(reliq_core::RetryPolicy::tiers([
            std::time::Duration::from_secs(5),
        ]))
        .asyncapi(
            reliq_core::AsyncApi::new("billing", "1.0.0"),
            Codec::<OrderV2>::schema(&Avro::<OrderV2>::new()),
        )
        .await?;
    let json = doc.to_json();
    let payload = &json["components"]["messages"]["shop_OrderCreated_deadLetter"]["payload"];
    ensure!(
        payload["schemaFormat"] == reliq_core::AVRO_SCHEMA_FORMAT
            && payload["schema"]["name"] == "OrderCreated",
        "{payload}"
    );
    same_as_committed(
        &docs.join("billing-avro.kafka.json"),
        &doc.to_string(),
        write,
    )
}

/// `text` is what `file` holds (or, with `write`, becomes it).
fn same_as_committed(file: &std::path::Path, text: &str, write: bool) -> anyhow::Result<()> {
    {
        if write {
            std::fs::write(file, text)?;
            return Ok(());
        }
        let committed =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        ensure!(
            committed == text,
            "{} is not the document reliq generates; regenerate it with \
             `RELIQ_WRITE_ASYNCAPI=1 cargo nextest run --workspace -E \
             'test(the_orders_asyncapi_document)'`",
            file.display()
        );
    }
    Ok(())
}

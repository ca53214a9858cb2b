//! Kafka with TLS, SASL and ACLs enforced (`scripts/brokers secure up`): the conformance
//! scenarios for delivery, retries, dead letters and the dead-letter reader, each run by
//! a principal that holds only the ACLs `reliq topology permissions` printed for its
//! consumer; one printed ACL left out fails with an error naming its resource; and every
//! way a connection is refused fails fast, naming the cause and no secret.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reliq_core::{Access, Broker, BrokerError, Destination, Message, Subscription};
use reliq_integration::secure::{
    SecuredKafkaBackend, acl_lines, admin_url, apply, mtls_url, pki_file, scram_url,
};
use reliq_integration::settings;
use reliq_kafka::KafkaBroker;

/// One test per scenario and way in (`scram`, `mtls`); `$names` are the consumer names
/// the scenario starts (each gets its printed grants).
macro_rules! secured {
    ($way:ident: $($scenario:ident => $names:expr),+ $(,)?) => {
        mod $way {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() -> anyhow::Result<()> {
                    reliq_conformance::$scenario(&SecuredKafkaBackend::$way($names)).await
                }
            )+
        }
    };
}

secured!(scram:
    publish_consume_ack_keeps_payload_headers_and_id => &["c"],
    one_transient_failure_retried_after_its_delay => &["c"],
    exhausted_budget_dead_letters_with_max_attempts => &["c"],
    poison_dead_letters_at_once => &["c"],
    dead_letter_metadata_complete_and_decodable => &["meta"],
    dead_letter_get_and_remove_by_id => &["c"],
    dead_letter_pages_cover_every_entry_once => &["c"],
    replay_returns_to_consumer_with_same_id_and_marker => &["c"],
);

secured!(mtls:
    publish_consume_ack_keeps_payload_headers_and_id => &["c"],
    one_transient_failure_retried_after_its_delay => &["c"],
    exhausted_budget_dead_letters_with_max_attempts => &["c"],
    poison_dead_letters_at_once => &["c"],
    dead_letter_get_and_remove_by_id => &["c"],
    replay_returns_to_consumer_with_same_id_and_marker => &["c"],
);

/// How long a refused connection may take to fail: librdkafka's first connection
/// attempt and its error callback, not a request timeout (30 s).
const FAST: Duration = Duration::from_secs(10);

fn unique(base: &str) -> String {
    reliq_conformance::support::unique(base)
}

/// A publish with `url`: the error, and how long it took.
async fn publish_with(url: &str) -> (Result<(), BrokerError>, Duration) {
    // librdkafka's own reports, shown with a failure.
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let broker = KafkaBroker::connect(url).expect("a valid URL");
    let started = Instant::now();
    let result = broker
        .publish(&Destination::new(unique("refused")), Message::new("x"))
        .await;
    (result, started.elapsed())
}

fn assert_fast_refusal(
    what: &str,
    (result, took): (Result<(), BrokerError>, Duration),
    cause: &str,
) -> String {
    let e = result.expect_err(what);
    let text = reliq_core::ErrorChain(&e).to_string();
    assert!(took < FAST, "{what}: took {took:?} to fail: {text}");
    assert!(
        text.contains(cause),
        "{what}: `{text}` does not name `{cause}`"
    );
    for secret in [
        settings::get("KAFKA_SECURE_SCRAM_PASSWORD"),
        settings::get("KAFKA_SECURE_ADMIN_PASSWORD"),
        "wrong-password".to_owned(),
    ] {
        assert!(!text.contains(&secret), "{what}: a secret in `{text}`");
    }
    text
}

#[tokio::test]
async fn a_wrong_scram_password_fails_fast_as_unauthorized() {
    let user = settings::get("KAFKA_SECURE_SCRAM_USER");
    let (result, took) = publish_with(&scram_url(&user, "wrong-password")).await;
    assert!(
        matches!(result, Err(BrokerError::Unauthorized { .. })),
        "{result:?}"
    );
    assert_fast_refusal("wrong password", (result, took), "SASL authentication");
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_fails_fast() {
    let url = scram_url("admin", &settings::get("KAFKA_SECURE_ADMIN_PASSWORD"))
        .replace(&pki_file("ca.crt"), &pki_file("rogue-ca.crt"));
    let text = assert_fast_refusal("wrong CA", publish_with(&url).await, "TLS with");
    assert!(text.contains("certificate verify failed"), "{text}");
}

#[tokio::test]
async fn an_expired_client_certificate_fails_fast() {
    let url = mtls_url("expired", "ca");
    assert_fast_refusal("expired certificate", publish_with(&url).await, "TLS with");
}

#[tokio::test]
async fn a_client_certificate_from_another_ca_fails_fast() {
    let url = mtls_url("rogue", "ca");
    assert_fast_refusal("rogue certificate", publish_with(&url).await, "TLS with");
}

#[tokio::test]
async fn a_plaintext_client_on_a_tls_port_fails_fast_naming_the_protocol() {
    let url = format!(
        "kafka://127.0.0.1:{}",
        settings::get("KAFKA_SECURE_SASL_SSL_PORT")
    );
    let (result, took) = publish_with(&url).await;
    assert!(
        matches!(&result, Err(BrokerError::Config { field, .. }) if field == "security.protocol"),
        "{result:?}"
    );
    assert_fast_refusal("plaintext on TLS", (result, took), "security.protocol");
}

#[tokio::test]
async fn scram_sha_256_without_tls_and_plain_and_oauthbearer_over_tls_connect() -> anyhow::Result<()>
{
    let admin_password = settings::get("KAFKA_SECURE_ADMIN_PASSWORD");
    let ca = pki_file("ca.crt");
    let sasl_ssl = settings::get("KAFKA_SECURE_SASL_SSL_PORT");
    // Secrets from a file: the URL holds a path, not the password.
    let secret = tempfile::NamedTempFile::new()?;
    std::fs::write(secret.path(), format!("{admin_password}\n"))?;
    let urls = [
        format!(
            "kafka://127.0.0.1:{}?security.protocol=sasl_plaintext&sasl.mechanism=SCRAM-SHA-256\
             &sasl.username=admin&sasl.password.file={}",
            settings::get("KAFKA_SECURE_SASL_PLAINTEXT_PORT"),
            secret.path().display()
        ),
        format!(
            "kafka://127.0.0.1:{sasl_ssl}?security.protocol=sasl_ssl&sasl.mechanism=PLAIN\
             &sasl.username=admin&sasl.password={admin_password}&ssl.ca.location={ca}"
        ),
        // The broker's unsecured-JWT validator; librdkafka makes the unsecured token.
        format!(
            "kafka://127.0.0.1:{sasl_ssl}?security.protocol=sasl_ssl&sasl.mechanism=OAUTHBEARER\
             &enable.sasl.oauthbearer.unsecure.jwt=true&sasl.oauthbearer.config=principal%3Dadmin\
             &ssl.ca.location={ca}"
        ),
    ];
    let admin = KafkaBroker::connect(&admin_url())?;
    for url in urls {
        let topic = unique("ways-in");
        admin.ensure_topics(std::slice::from_ref(&topic)).await?;
        let broker = KafkaBroker::connect(&url)?;
        let shown = format!("{:?}", broker.config());
        assert!(!shown.contains(&admin_password), "{shown}");
        broker
            .publish(&Destination::new(topic.clone()), Message::new("in"))
            .await
            .map_err(|e| {
                anyhow::anyhow!(
                    "{}: {}",
                    reliq_core::seam::secrets::redact_url(&url),
                    reliq_core::ErrorChain(&e)
                )
            })?;
    }
    Ok(())
}

/// The principal holds its consumer's printed grants but publishes to a topic it was
/// granted nothing on: refused at once as unauthorized (a permanent failure), naming the
/// topic — not retried until a timeout.
#[tokio::test]
async fn publishing_without_an_acl_is_refused_naming_the_topic_and_is_permanent()
-> anyhow::Result<()> {
    let backend = SecuredKafkaBackend::scram(&["c"]);
    let topic = unique("granted");
    reliq_conformance::Backend::prepare(&backend, &topic).await?;
    let broker = reliq_conformance::Backend::connect(&backend).await?;
    let other = unique("not-granted");
    KafkaBroker::connect(&admin_url())?
        .ensure_topics(std::slice::from_ref(&other))
        .await?;
    let started = Instant::now();
    let e = broker
        .publish(&Destination::new(other.clone()), Message::new("x"))
        .await
        .expect_err("no Write on the topic");
    assert!(started.elapsed() < FAST, "took {:?}", started.elapsed());
    assert!(
        matches!(&e, BrokerError::Unauthorized { resource, .. } if *resource == format!("topic {other}")),
        "{e:?}"
    );
    assert_eq!(
        reliq_core::Classifier::default().classify(&e),
        reliq_core::ErrorClass::Permanent
    );
    // And the granted topic works with the same connection.
    broker
        .publish(&Destination::new(topic), Message::new("y"))
        .await?;
    Ok(())
}

/// Leaving out one printed ACL — the retry tiers' topics — makes the retry scenario fail
/// at the consumer's start with an authorization error naming the retry topic.
#[tokio::test]
async fn without_the_printed_retry_topic_acl_the_retry_scenario_fails_naming_it() {
    let backend = SecuredKafkaBackend::scram(&["c"])
        .keeping(|line| !(line.contains(".c.retry. ") && line.contains("--topic")));
    let e = reliq_conformance::one_transient_failure_retried_after_its_delay(&backend)
        .await
        .expect_err("no ACL on the retry topics");
    let text = format!("{e:#}");
    assert!(text.contains("not authorized: topic "), "{text}");
    assert!(text.contains(".c.retry.1000ms"), "{text}");
}

/// The document parses into exactly the grants it was made from (so applying it as
/// printed applies the plan), and applying it twice is harmless.
#[tokio::test]
async fn the_printed_acls_are_the_grants_and_apply_idempotently() -> anyhow::Result<()> {
    let broker: Arc<dyn Broker> = Arc::new(KafkaBroker::connect(&admin_url())?);
    let mut sub = Subscription::new("billing", unique("orders"));
    sub.retry_tiers = vec![Duration::from_secs(5)];
    let p = broker
        .permissions(&Access::consumer(sub).operator().principal("User:nobody"))
        .await?;
    let lines = acl_lines(&p.document)?;
    assert_eq!(lines.len(), p.grants.len());
    for (line, grant) in lines.iter().zip(&p.grants) {
        assert_eq!(line.principal, "User:nobody");
        assert_eq!(line.resource, grant.resource);
        assert_eq!(line.name, grant.name);
        assert_eq!(line.operations, grant.operations);
        assert_eq!(
            line.prefixed,
            grant.pattern == reliq_core::NamePattern::Prefixed
        );
    }
    apply(&p.document).await?;
    apply(&p.document).await?;
    Ok(())
}

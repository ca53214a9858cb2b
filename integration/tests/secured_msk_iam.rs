//! AWS MSK IAM sign-in (`sasl.oauthbearer.method=aws_msk_iam`) on the secured Kafka
//! node's MSK IAM stand-in listener (`scripts/brokers secure up`), which validates a token
//! as MSK does: a SigV4-presigned `kafka-cluster:Connect` request for the listener's test
//! key, its signature recomputed with the key's secret, signed for now
//! (`scripts/brokers.d/msk-iam/MskIamValidator.java`). The key is a super user there, so
//! the scenarios show that every client reliq makes — both producers, the admin client
//! (which rdkafka never asks for a token itself), the group consumers, the relays and the
//! dead-letter reader — signs in; the policy reliq prints for MSK is unit-tested in
//! reliq-kafka.
//!
//! Credentials come from the AWS default chain: each test sets the environment first
//! (see `reliq_integration::aws_env::Env`), then starts its runtime.

use std::time::{Duration, Instant};

use reliq_core::{Broker, BrokerError, Destination, Message};
use reliq_integration::aws_env::{Env, runtime};
use reliq_integration::kafka::KafkaBackend;
use reliq_integration::secure::msk_iam_url;
use reliq_integration::settings;
use reliq_kafka::KafkaBroker;

/// How long a refused sign-in may take to fail: the first connection attempt, not a
/// request timeout (30 s).
const FAST: Duration = Duration::from_secs(10);

/// The listener's test key in the environment (with `secret`).
fn signed_in_as_the_test_key(secret: &str) -> anyhow::Result<Env> {
    Env::set(&[
        (
            "AWS_ACCESS_KEY_ID",
            &settings::get("KAFKA_SECURE_MSK_IAM_KEY"),
        ),
        ("AWS_SECRET_ACCESS_KEY", secret),
    ])
}

fn test_secret() -> String {
    settings::get("KAFKA_SECURE_MSK_IAM_SECRET")
}

/// Run conformance `$scenario` on a backend whose every client signs in with MSK IAM.
macro_rules! over_msk_iam {
    ($($scenario:ident),+ $(,)?) => {
        $(
            #[test]
            fn $scenario() -> anyhow::Result<()> {
                let _env = signed_in_as_the_test_key(&test_secret())?;
                runtime()?.block_on(async {
                    let backend = KafkaBackend::on(&msk_iam_url(), None);
                    reliq_conformance::$scenario(&backend).await
                })
            }
        )+
    };
}

over_msk_iam!(
    publish_consume_ack_keeps_payload_headers_and_id,
    one_transient_failure_retried_after_its_delay,
    exhausted_budget_dead_letters_with_max_attempts,
    dead_letter_get_and_remove_by_id,
);

/// The admin client alone: topics created and seen through it.
#[test]
fn the_admin_client_signs_in_and_creates_topics() -> anyhow::Result<()> {
    let _env = signed_in_as_the_test_key(&test_secret())?;
    runtime()?.block_on(async {
        let broker = KafkaBroker::connect(&msk_iam_url())?;
        let topic = reliq_conformance::support::unique("msk-iam-admin");
        let started = Instant::now();
        tokio::time::timeout(FAST, broker.ensure_topics(std::slice::from_ref(&topic))).await??;
        assert!(broker.topic_exists(&topic).await?, "{topic} not created");
        assert!(started.elapsed() < FAST, "took {:?}", started.elapsed());
        broker.delete_topics(&[topic]).await?;
        Ok(())
    })
}

/// A publish with the MSK IAM URL: the error, and how long it took.
async fn publish() -> (Result<(), BrokerError>, Duration) {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let broker = KafkaBroker::connect(&msk_iam_url()).expect("a valid URL");
    let started = Instant::now();
    let result = broker
        .publish(
            &Destination::new(reliq_conformance::support::unique("msk-iam")),
            Message::new("x"),
        )
        .await;
    (result, started.elapsed())
}

#[test]
fn a_token_signed_with_the_wrong_secret_is_refused_fast_as_unauthorized() -> anyhow::Result<()> {
    let _env = signed_in_as_the_test_key("not-the-secret")?;
    let (result, took) = runtime()?.block_on(publish());
    let e = result.expect_err("a refused token");
    let text = reliq_core::ErrorChain(&e).to_string();
    assert!(matches!(e, BrokerError::Unauthorized { .. }), "{text}");
    assert!(took < FAST, "took {took:?}: {text}");
    assert!(text.contains("SASL authentication"), "{text}");
    assert!(!text.contains("not-the-secret"), "the secret shows: {text}");
    Ok(())
}

#[test]
fn without_aws_credentials_the_sign_in_fails_fast_naming_them() -> anyhow::Result<()> {
    // Nothing in the environment, empty profile files, no instance metadata.
    let _env = Env::set(&[])?;
    let (result, took) = runtime()?.block_on(publish());
    let e = result.expect_err("no credentials");
    let text = reliq_core::ErrorChain(&e).to_string();
    assert!(matches!(e, BrokerError::Unauthorized { .. }), "{text}");
    assert!(took < FAST, "took {took:?}: {text}");
    assert!(text.contains("AWS credentials"), "{text}");
    Ok(())
}

//! NATS JetStream servers that want TLS and a sign-in (`scripts/brokers secure up`): each
//! way of signing in a URL can name — user and password, an nkey seed, a client
//! certificate with a token, a credentials file (decentralized JWT auth) — runs the
//! delivery and dead-letter scenarios; refusals fail at once, naming the cause and no
//! secret.

use reliq_core::BrokerError;
use reliq_integration::nats::NatsBackend;
use reliq_integration::secure::{SecuredNatsBackend, nats_auth_file, nats_url, pki_file};
use reliq_integration::settings;
use reliq_nats::NatsBroker;

fn user_password() -> String {
    nats_url(
        "users",
        &format!(
            "user={}&password={}",
            settings::get("NATS_SECURE_USER"),
            settings::get("NATS_SECURE_PASSWORD")
        ),
    )
}

/// The nkey seed from its file (`nkey.file`): the URL holds a path, not the seed.
fn nkey_seed_file() -> String {
    nats_url(
        "users",
        &format!("nkey.file={}", nats_auth_file("nkey.seed")),
    )
}

fn mtls_and_token() -> String {
    nats_url(
        "mtls",
        &format!(
            "tls.cert={}&tls.key={}&token={}",
            pki_file("reliq-mtls.crt"),
            pki_file("reliq-mtls.key"),
            settings::get("NATS_SECURE_TOKEN")
        ),
    )
}

fn credentials_file() -> String {
    nats_url("jwt", &format!("creds={}", nats_auth_file("reliq.creds")))
}

/// One test per scenario and way of signing in.
macro_rules! secured {
    ($way:ident: $($scenario:ident),+ $(,)?) => {
        mod $way {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() -> anyhow::Result<()> {
                    reliq_conformance::$scenario(&NatsBackend::on(super::$way())).await
                }
            )+
        }
    };
}

secured!(user_password: publish_consume_ack_keeps_payload_headers_and_id, poison_dead_letters_at_once);
secured!(nkey_seed_file: publish_consume_ack_keeps_payload_headers_and_id, poison_dead_letters_at_once);
secured!(mtls_and_token: publish_consume_ack_keeps_payload_headers_and_id, poison_dead_letters_at_once);
secured!(credentials_file: publish_consume_ack_keeps_payload_headers_and_id);

/// The delivery, retry, dead-letter and reader scenarios as a user whose JWT allows only
/// the subjects `reliq topology permissions` printed for the scenario's consumer.
macro_rules! least_privilege {
    ($($scenario:ident => $names:expr),+ $(,)?) => {
        mod least_privilege {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() -> anyhow::Result<()> {
                    reliq_conformance::$scenario(&SecuredNatsBackend::new($names)).await
                }
            )+
        }
    };
}

least_privilege!(
    publish_consume_ack_keeps_payload_headers_and_id => &["c"],
    one_transient_failure_retried_after_its_delay => &["c"],
    exhausted_budget_dead_letters_with_max_attempts => &["c"],
    poison_dead_letters_at_once => &["c"],
    dead_letter_get_and_remove_by_id => &["c"],
    dead_letter_pages_cover_every_entry_once => &["c"],
);

/// Connecting with `url` is refused at once, naming no secret.
async fn refused(url: &str, secrets: &[&str]) -> BrokerError {
    reliq_integration::secure::refused(NatsBroker::connect(url), secrets).await
}

#[tokio::test]
async fn a_wrong_password_is_unauthorized() {
    let url = nats_url(
        "users",
        &format!(
            "user={}&password=wrong-password",
            settings::get("NATS_SECURE_USER")
        ),
    );
    let e = refused(&url, &["wrong-password"]).await;
    assert!(
        matches!(&e, BrokerError::Unauthorized { reason, .. } if reason.contains("authorization violation")),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_a_tls_error() {
    let url = user_password().replace(&pki_file("ca.crt"), &pki_file("rogue-ca.crt"));
    let e = refused(&url, &[&settings::get("NATS_SECURE_PASSWORD")]).await;
    assert!(
        matches!(&e, BrokerError::Config { field, .. } if field == "tls.*"),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_client_certificate_from_another_ca_is_refused() {
    let url = mtls_and_token()
        .replace(&pki_file("reliq-mtls.crt"), &pki_file("rogue.crt"))
        .replace(&pki_file("reliq-mtls.key"), &pki_file("rogue.key"));
    let e = refused(&url, &[&settings::get("NATS_SECURE_TOKEN")]).await;
    assert!(
        matches!(&e, BrokerError::Config { field, .. } if field == "tls.*"),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_missing_credentials_file_names_the_setting() {
    let url = nats_url("jwt", "creds=/nonexistent/reliq.creds");
    let e = refused(&url, &[]).await;
    assert!(
        matches!(&e, BrokerError::Config { field, .. } if field == "creds"),
        "{e:?}"
    );
}

#[tokio::test]
async fn user_without_password_is_a_config_error_naming_it() {
    let url = nats_url("users", "user=someone");
    let e = refused(&url, &[]).await;
    assert!(
        matches!(&e, BrokerError::Config { field, .. } if field == "password"),
        "{e:?}"
    );
}

/// The printed subjects are enforced, and needed: without the pull subject the minted
/// user's consumer receives nothing, the delivery scenario fails, and the log names the
/// refused subject.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_printed_pull_subject_nothing_is_delivered_and_the_log_names_it() {
    let log = reliq_conformance::support::captured_log().expect("the only subscriber");
    let backend = SecuredNatsBackend::new(&["c"])
        .keeping(|subject| !subject.starts_with("$JS.API.CONSUMER.MSG.NEXT."));
    let e = reliq_conformance::publish_consume_ack_keeps_payload_headers_and_id(&backend)
        .await
        .expect_err("no permission to pull");
    let text = format!("{e:#}");
    assert!(!text.contains("preparing the backend"), "{text}");
    let named = log
        .warnings()
        .into_iter()
        .find(|w| w.contains("Permissions Violation") && w.contains("$JS.API.CONSUMER.MSG.NEXT."));
    assert!(
        named.is_some(),
        "no error naming the pull subject: {:?}",
        log.warnings()
    );
}

/// A JetStream API subject left out: NATS does not answer the refused request, but the
/// failed declaration is `Unauthorized`, naming the subject the server reported refusing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_printed_stream_info_subject_the_scenario_fails_unauthorized_naming_it() {
    let backend = SecuredNatsBackend::new(&["c"])
        .keeping(|subject| !subject.starts_with("$JS.API.STREAM.INFO."));
    let e = reliq_conformance::publish_consume_ack_keeps_payload_headers_and_id(&backend)
        .await
        .expect_err("no permission to read the stream");
    let text = format!("{e:#}");
    assert!(!text.contains("preparing the backend"), "{text}");
    assert!(
        text.contains("not authorized: subject $JS.API.STREAM.INFO."),
        "{text}"
    );
}

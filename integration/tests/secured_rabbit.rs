//! RabbitMQ over TLS with the broker verifying client certificates
//! (`scripts/brokers secure up`): EXTERNAL sign-in with a client certificate and PLAIN
//! with a password run the delivery, retry, dead-letter and reader scenarios on a vhost
//! where the user holds only the regexes `reliq topology permissions` printed; one
//! regex alternative left out fails a scenario naming the queue; refusals (a wrong
//! password, an untrusted server, a refused, rogue or expired client certificate, a
//! vhost without permissions, plaintext to the TLS port) fail at once, naming the cause
//! and no secret.

use std::time::Duration;

use reliq_core::{Access, Broker, BrokerError, Subscription};
use reliq_integration::rabbit::RabbitBackend;
use reliq_integration::secure::{
    RabbitSignIn, SecuredRabbitBackend, pki_file, rabbit_admin_url, rabbit_management,
    rabbit_mtls_url, rabbit_password_url, rabbit_permission_words, rabbit_url, rabbit_vhost,
};
use reliq_integration::settings;
use reliq_rabbit::{RabbitBroker, RabbitOptions};

macro_rules! least_privilege {
    ($way:ident = $sign_in:expr => $($scenario:ident),+ $(,)?) => {
        mod $way {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() -> anyhow::Result<()> {
                    reliq_conformance::$scenario(&SecuredRabbitBackend::new(&["c"], $sign_in)).await
                }
            )+
        }
    };
}

least_privilege!(certificate = RabbitSignIn::Certificate =>
    publish_consume_ack_keeps_payload_headers_and_id,
    one_transient_failure_retried_after_its_delay,
    exhausted_budget_dead_letters_with_max_attempts,
    poison_dead_letters_at_once,
    dead_letter_get_and_remove_by_id,
    dead_letter_pages_cover_every_entry_once,
);
least_privilege!(password = RabbitSignIn::Password =>
    publish_consume_ack_keeps_payload_headers_and_id,
    poison_dead_letters_at_once,
);

/// Leaving the consumer queue out of the printed read regex makes the delivery scenario
/// fail at the consumer's start with an authorization error naming that queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_printed_read_on_the_consumer_queue_the_scenario_fails_naming_it() {
    let backend = SecuredRabbitBackend::new(&["c"], RabbitSignIn::Certificate)
        .keeping(|operation, alternative| !(operation == "read" && alternative.ends_with(r"\.c")));
    let e = reliq_conformance::publish_consume_ack_keeps_payload_headers_and_id(&backend)
        .await
        .expect_err("no read on the consumer queue");
    let text = format!("{e:#}");
    assert!(!text.contains("preparing the backend"), "{text}");
    let unauthorized = e
        .chain()
        .find_map(|c| c.downcast_ref::<BrokerError>())
        .filter(|b| matches!(b, BrokerError::Unauthorized { .. }));
    assert!(unauthorized.is_some(), "not an authorization error: {text}");
    assert!(
        text.contains(".c' in vhost"),
        "the queue is not named: {text}"
    );
    assert!(text.contains("ACCESS_REFUSED"), "{text}");
}

/// The printed regexes are the grants: every granted queue matches the operations its
/// grant lists and no other, and the user is the one the certificate signs in as.
#[tokio::test]
async fn the_printed_regexes_hold_exactly_the_grants() -> anyhow::Result<()> {
    let vhost = reliq_conformance::support::unique("perm");
    rabbit_vhost(&rabbit_management()?, &vhost).await?;
    let broker = RabbitBackend::connect_url(&rabbit_admin_url(&vhost)).await?;
    let mut sub = Subscription::new("billing", "orders");
    sub.retry_tiers = vec![Duration::from_secs(5)];
    let p = broker
        .permissions(&Access::consumer(sub).operator().principal("reliq-mtls"))
        .await?;
    let [v, user, configure, write, read] = rabbit_permission_words(&p.document)?;
    assert_eq!((v.as_str(), user.as_str()), (vhost.as_str(), "reliq-mtls"));
    let [configure, write, read] =
        [configure, write, read].map(|r| regex::Regex::new(&r).expect("a regex"));
    for g in &p.grants {
        let name = match g.pattern {
            reliq_core::NamePattern::Literal => g.name.clone(),
            reliq_core::NamePattern::Prefixed => format!("{}5000ms", g.name),
        };
        for (op, regex) in [
            ("configure", &configure),
            ("write", &write),
            ("read", &read),
        ] {
            assert_eq!(
                regex.is_match(&name),
                g.operations.contains(&op),
                "{op} on {name}: {}",
                p.document
            );
        }
    }
    Ok(())
}

/// Connecting with `url` is refused at once, naming no secret.
async fn refused(url: &str, secrets: &[&str]) -> BrokerError {
    reliq_integration::secure::refused(reliq_rabbit::connect(url), secrets).await
}

#[tokio::test]
async fn a_wrong_password_is_unauthorized() {
    let url = rabbit_url(
        &format!("{}:wrong-password@", settings::get("RABBITMQ_SECURE_USER")),
        "/",
        "",
    );
    let e = refused(&url, &["wrong-password"]).await;
    assert!(
        matches!(&e, BrokerError::Unauthorized { reason, .. } if reason.contains("ACCESS_REFUSED")),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_vhost_without_permissions_is_unauthorized_naming_it() {
    // The user exists and signs in, but holds nothing on `/`.
    let e = refused(
        &rabbit_password_url("/"),
        &[&settings::get("RABBITMQ_SECURE_PASSWORD")],
    )
    .await;
    assert!(
        matches!(&e, BrokerError::Unauthorized { resource, .. } if resource == "vhost '/'"),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_names_cacertfile() {
    let url = rabbit_password_url("/").replace(&pki_file("ca.crt"), &pki_file("rogue-ca.crt"));
    let e = refused(&url, &[&settings::get("RABBITMQ_SECURE_PASSWORD")]).await;
    assert!(
        matches!(&e, BrokerError::Config { field, reason } if field == "cacertfile" && reason.contains("UnknownIssuer")),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_client_certificate_from_another_ca_names_certfile() {
    let e = refused(&rabbit_mtls_url("/", "rogue"), &[]).await;
    assert!(
        matches!(&e, BrokerError::Config { field, .. } if field == "certfile"),
        "{e:?}"
    );
}

#[tokio::test]
async fn an_expired_client_certificate_names_certfile_and_expiry() {
    let e = refused(&rabbit_mtls_url("/", "expired"), &[]).await;
    assert!(
        // The broker's alert names the expiry, unless it loses the race with the socket's
        // reset (TLS 1.3 judges the client certificate after the handshake).
        matches!(&e, BrokerError::Config { field, reason } if field == "certfile"
            && (reason.contains("CertificateExpired")
                || reason.contains("reset the connection right after the TLS handshake"))),
        "{e:?}"
    );
}

#[tokio::test]
async fn external_without_a_client_certificate_is_unauthorized() {
    let url = rabbit_url("", "/", "&auth_mechanism=external");
    let e = refused(&url, &[]).await;
    assert!(matches!(&e, BrokerError::Unauthorized { .. }), "{e:?}");
}

#[tokio::test]
async fn plaintext_to_the_tls_port_fails_fast() {
    let url = rabbit_password_url("/").replacen("amqps://", "amqp://", 1);
    let e = refused(&url, &[&settings::get("RABBITMQ_SECURE_PASSWORD")]).await;
    assert!(matches!(&e, BrokerError::Connection { .. }), "{e:?}");
}

#[tokio::test]
async fn missing_certificate_files_are_config_errors_naming_the_setting() {
    let url = rabbit_password_url("/").replace(&pki_file("ca.crt"), "/nonexistent/ca.crt");
    let e = refused(&url, &[]).await;
    assert!(
        matches!(&e, BrokerError::Config { field, .. } if field == "cacertfile"),
        "{e:?}"
    );
    let url = rabbit_url(
        "",
        "/",
        &format!("&certfile={}", pki_file("reliq-mtls.crt")),
    );
    let e = refused(&url, &[]).await;
    assert!(
        matches!(&e, BrokerError::Config { field, .. } if field == "keyfile"),
        "{e:?}"
    );
}

/// The password from a file: the URL (and every `Debug` of the options) holds a path.
#[tokio::test]
async fn the_password_comes_from_a_file_and_is_never_printed() -> anyhow::Result<()> {
    let vhost = reliq_conformance::support::unique("pwfile");
    let api = rabbit_management()?;
    rabbit_vhost(&api, &vhost).await?;
    let user = settings::get("RABBITMQ_SECURE_USER");
    let password = settings::get("RABBITMQ_SECURE_PASSWORD");
    api.put(
        &format!(
            "/api/permissions/{}/{user}",
            reliq_rabbit::encode_segment(&vhost)
        ),
        &serde_json::json!({"configure": "^$", "write": "^$", "read": "^$"}),
    )
    .await?;
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), format!("{password}\n"))?;
    let url = rabbit_url(
        &format!("{user}@"),
        &vhost,
        &format!(
            "&password.file={}&reliq.management={}",
            file.path().display(),
            settings::get("RABBITMQ_SECURE_MGMT_PORT")
        ),
    );
    let (stripped, options) = RabbitOptions::from_url(&url)?;
    assert!(!url.contains(&password));
    let shown = format!("{options:?}");
    assert!(!shown.contains(&password), "{shown}");
    assert!(shown.contains("***"), "{shown}");
    // Queue arguments: this user has no management tag to set policies with.
    let options = RabbitOptions {
        queue_settings: reliq_rabbit::QueueSettings::Arguments,
        ..options
    };
    let broker = RabbitBroker::connect_with(&stripped, options).await?;
    assert_eq!(broker.kind(), "rabbit");
    Ok(())
}

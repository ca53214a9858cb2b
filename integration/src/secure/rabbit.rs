//! The secured RabbitMQ node: AMQPS URLs (password, EXTERNAL), the admin's management
//! API over HTTPS, and a vhost per test where the client's user holds the regexes
//! `reliq topology permissions` prints.

use std::sync::Arc;

use anyhow::{Context as _, bail};
use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Access, Broker};

use super::{Issuer, Secured, pki, pki_file, port, scenario_subscriptions};
use crate::rabbit::RabbitBackend;
use crate::settings;

/// The secured RabbitMQ node's AMQPS URL on `vhost` (percent-encoded) for `auth`: the
/// user info (`user:password@`, or empty) and extra query (`&…`), trusting the test CA.
pub fn rabbit_url(userinfo: &str, vhost: &str, query: &str) -> String {
    format!(
        "amqps://{userinfo}127.0.0.1:{}/{}?cacertfile={}{query}",
        port("RABBITMQ_SECURE_PORT"),
        reliq_rabbit::encode_segment(vhost),
        pki_file("ca.crt"),
    )
}

/// The admin (administrator tag, all of `vhost`), with the management API over HTTPS.
pub fn rabbit_admin_url(vhost: &str) -> String {
    rabbit_url(
        &format!("admin:{}@", settings::get("RABBITMQ_SECURE_ADMIN_PASSWORD")),
        vhost,
        &format!("&reliq.management={}", port("RABBITMQ_SECURE_MGMT_PORT")),
    )
}

/// EXTERNAL: the client certificate `cert` signs in as its CN.
pub fn rabbit_mtls_url(vhost: &str, cert: &str) -> String {
    rabbit_url(
        "",
        vhost,
        &format!(
            "&auth_mechanism=external&certfile={}&keyfile={}",
            pki_file(&format!("{cert}.crt")),
            pki_file(&format!("{cert}.key"))
        ),
    )
}

/// The password user `RABBITMQ_SECURE_USER` (PLAIN over TLS, no client certificate).
pub fn rabbit_password_url(vhost: &str) -> String {
    rabbit_url(
        &format!(
            "{}:{}@",
            settings::get("RABBITMQ_SECURE_USER"),
            settings::get("RABBITMQ_SECURE_PASSWORD")
        ),
        vhost,
        "",
    )
}

/// The admin's management API client on the secured node.
pub fn rabbit_management() -> anyhow::Result<reliq_rabbit::Management> {
    let tls = reliq_rabbit::Tls {
        ca: Some(pki().join("ca.crt")),
        ..reliq_rabbit::Tls::default()
    };
    Ok(reliq_rabbit::Management::with_tls(
        &format!(
            "https://admin:{}@127.0.0.1:{}",
            settings::get("RABBITMQ_SECURE_ADMIN_PASSWORD"),
            port("RABBITMQ_SECURE_MGMT_PORT")
        ),
        &tls,
    )?)
}

/// A new vhost on the secured node where the admin may do anything.
pub async fn rabbit_vhost(api: &reliq_rabbit::Management, vhost: &str) -> anyhow::Result<()> {
    let v = reliq_rabbit::encode_segment(vhost);
    api.put(&format!("/api/vhosts/{v}"), &serde_json::json!({}))
        .await?;
    let all = serde_json::json!({"configure": ".*", "write": ".*", "read": ".*"});
    api.put(&format!("/api/permissions/{v}/admin"), &all)
        .await?;
    Ok(())
}

/// The `rabbitmqctl set_permissions -p VHOST USER CONFIGURE WRITE READ` line of a
/// permissions document, as its five (single-quoted) words.
pub fn rabbit_permission_words(document: &str) -> anyhow::Result<[String; 5]> {
    let line = document
        .lines()
        .find(|l| l.starts_with("rabbitmqctl set_permissions -p "))
        .with_context(|| format!("no set_permissions line in:\n{document}"))?;
    let words: Vec<String> = line
        .split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    words
        .try_into()
        .map_err(|w| anyhow::anyhow!("not five quoted words in `{line}`: {w:?}"))
}

/// Which printed regex alternatives a [`SecuredRabbitBackend`] applies: `(operation,
/// alternative)`, e.g. `("read", r"orders\.c")`.
pub type AlternativeFilter = fn(&str, &str) -> bool;

/// `^(a|b|c)$` without the alternatives `keep` refuses (`^$` when none is left).
fn filtered_regex(operation: &str, regex: &str, keep: AlternativeFilter) -> String {
    let Some(inner) = regex.strip_prefix("^(").and_then(|r| r.strip_suffix(")$")) else {
        return regex.to_owned();
    };
    let kept: Vec<&str> = inner.split('|').filter(|a| keep(operation, a)).collect();
    if kept.is_empty() {
        "^$".to_owned()
    } else {
        format!("^({})$", kept.join("|"))
    }
}

/// How the scenario's client signs in to the secured RabbitMQ node.
#[derive(Clone, Copy, Debug)]
pub enum RabbitSignIn {
    /// EXTERNAL with the test client certificate (user = its CN).
    Certificate,
    /// PLAIN with `RABBITMQ_SECURE_USER`'s password, over TLS.
    Password,
}

/// The conformance factory on the secured RabbitMQ node: each test gets a vhost of its
/// own (its topic), where the client's user holds only the configure / write / read
/// regexes `reliq topology permissions` prints for the scenario's consumers (operator
/// and publishing to the source included), applied through the management API as
/// printed; the admin declares the source and breaks routes for the fault scenarios.
pub type SecuredRabbitBackend = Secured<RabbitVhost>;

/// Makes the test's vhost and grants the printed regexes on it ([`SecuredRabbitBackend`]).
pub struct RabbitVhost {
    consumers: &'static [&'static str],
    sign_in: RabbitSignIn,
    keep: AlternativeFilter,
}

impl Secured<RabbitVhost> {
    /// For the scenario's consumer names, signing in with `sign_in`.
    pub fn new(consumers: &'static [&'static str], sign_in: RabbitSignIn) -> Self {
        let vhost = RabbitVhost {
            consumers,
            sign_in,
            keep: |_, _| true,
        };
        Self::with(vhost, RabbitBackend::new())
    }

    /// Grant only the printed regex alternatives `keep` accepts.
    #[must_use]
    pub fn keeping(mut self, keep: AlternativeFilter) -> Self {
        self.issuer.keep = keep;
        self
    }
}

impl RabbitVhost {
    fn user(&self) -> String {
        match self.sign_in {
            RabbitSignIn::Certificate => settings::get("KAFKA_SECURE_MTLS_USER"),
            RabbitSignIn::Password => settings::get("RABBITMQ_SECURE_USER"),
        }
    }
}

#[async_trait]
impl Issuer for RabbitVhost {
    fn name(&self) -> &'static str {
        "rabbit"
    }

    async fn issue(&self, timings: &dyn Backend, topic: &str) -> anyhow::Result<Box<dyn Backend>> {
        let api = rabbit_management()?;
        rabbit_vhost(&api, topic).await?;
        let client_url = match self.sign_in {
            RabbitSignIn::Certificate => rabbit_mtls_url(topic, "reliq-mtls"),
            RabbitSignIn::Password => rabbit_password_url(topic),
        };
        let admin_url = rabbit_admin_url(topic);
        let admin: Arc<dyn Broker> = Arc::new(RabbitBackend::connect_url(&admin_url).await?);
        let access = Access {
            consumers: scenario_subscriptions(timings, &admin, topic, self.consumers)?,
            publishes: vec![topic.to_owned()],
            principal: Some(self.user()),
            operator: true,
        };
        let permissions = admin.permissions(&access).await?;
        let [vhost, user, configure, write, read] = rabbit_permission_words(&permissions.document)?;
        if vhost != topic || user != self.user() {
            bail!(
                "the document grants {user} on {vhost}:\n{}",
                permissions.document
            );
        }
        let keep = self.keep;
        api.put(
            &format!(
                "/api/permissions/{}/{}",
                reliq_rabbit::encode_segment(&vhost),
                reliq_rabbit::encode_segment(&user)
            ),
            &serde_json::json!({
                "configure": filtered_regex("configure", &configure, keep),
                "write": filtered_regex("write", &write, keep),
                "read": filtered_regex("read", &read, keep),
            }),
        )
        .await?;
        Ok(Box::new(RabbitBackend::on(&admin_url, &client_url, topic)))
    }
}

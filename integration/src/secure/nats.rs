//! The secured NATS servers: their URLs, and users minted per test (decentralized auth)
//! with only the subjects `reliq topology permissions` prints.

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Access, Permissions};

use super::{Issuer, Secured, pki, pki_file, port, scenario_subscriptions};
use crate::nats::NatsBackend;

/// `<repo>/.brokers/secure/nats-auth/NAME`: the NATS credentials file and nkeys.
pub fn nats_auth_file(name: &str) -> String {
    pki()
        .with_file_name("nats-auth")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// A secured NATS server (`users`, `mtls`, `jwt`: its port key in brokers.env) with the
/// query `auth` (the way of signing in), trusting the test CA.
pub fn nats_url(server: &str, auth: &str) -> String {
    let key = format!("NATS_SECURE_{}_PORT", server.to_ascii_uppercase());
    format!(
        "tls://127.0.0.1:{}?tls.ca={}{}{auth}",
        port(&key),
        pki_file("ca.crt"),
        if auth.is_empty() { "" } else { "&" },
    )
}

/// The conformance factory on the JWT-authenticated NATS server: each test's consumers run
/// as a user minted for it (`scripts/brokers secure nats-user`) whose JWT allows only the
/// subjects `reliq topology permissions` prints for them (consumer, operator, publishing
/// to the source).
pub type SecuredNatsBackend = Secured<NatsUser>;

/// Mints the test's NATS user ([`SecuredNatsBackend`]).
pub struct NatsUser {
    consumers: &'static [&'static str],
    /// Which printed subjects the minted user gets (all but one: to show one is needed).
    keep: fn(&str) -> bool,
}

impl Secured<NatsUser> {
    /// For the scenario's consumer names.
    pub fn new(consumers: &'static [&'static str]) -> Self {
        Self::with(
            NatsUser {
                consumers,
                keep: |_| true,
            },
            NatsBackend::new(),
        )
    }

    /// Mint the user with only the printed subjects `keep` accepts.
    #[must_use]
    pub fn keeping(mut self, keep: fn(&str) -> bool) -> Self {
        self.issuer.keep = keep;
        self
    }
}

/// `{"publish": [...], "subscribe": [...]}` of a NATS permissions' grants.
pub fn nats_subjects(permissions: &Permissions) -> serde_json::Value {
    let of = |op: &str| -> Vec<&str> {
        permissions
            .grants
            .iter()
            .filter(|g| g.operations.contains(&op))
            .map(|g| g.name.as_str())
            .collect()
    };
    serde_json::json!({ "publish": of("publish"), "subscribe": of("subscribe") })
}

/// The credentials file of a new user of the JWT server allowed only `subjects`:
/// `.brokers/secure/nats-auth/minted/<name>.creds` (thrown away with the secured set).
pub async fn mint_nats_user(name: &str, subjects: &serde_json::Value) -> anyhow::Result<PathBuf> {
    use tokio::io::AsyncWriteExt as _;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/brokers");
    let mut child = tokio::process::Command::new(script)
        .args(["secure", "nats-user", name])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running scripts/brokers secure nats-user")?;
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin.write_all(subjects.to_string().as_bytes()).await?;
    drop(stdin);
    let out = child.wait_with_output().await?;
    if !out.status.success() {
        bail!("nats-user: {}", String::from_utf8_lossy(&out.stderr));
    }
    let dir = PathBuf::from(nats_auth_file("minted"));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join(format!("{name}.creds"));
    std::fs::write(&file, &out.stdout)?;
    Ok(file)
}

#[async_trait]
impl Issuer for NatsUser {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn issue(&self, timings: &dyn Backend, topic: &str) -> anyhow::Result<Box<dyn Backend>> {
        // The permissions are computed by any connection: they read nothing.
        let full: std::sync::Arc<dyn reliq_core::Broker> = std::sync::Arc::new(
            reliq_nats::NatsBroker::connect(&nats_url(
                "jwt",
                &format!("creds={}", nats_auth_file("reliq.creds")),
            ))
            .await?,
        );
        let access = Access {
            consumers: scenario_subscriptions(timings, &full, topic, self.consumers)?,
            publishes: vec![topic.to_owned()],
            principal: Some(topic.to_owned()),
            operator: true,
        };
        let mut permissions = full.permissions(&access).await?;
        let keep = self.keep;
        permissions.grants.retain(|g| keep(&g.name));
        let creds = mint_nats_user(topic, &nats_subjects(&permissions)).await?;
        let url = nats_url("jwt", &format!("creds={}", creds.display()));
        Ok(Box::new(NatsBackend::on(url)))
    }
}

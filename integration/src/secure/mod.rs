//! The secured broker set `scripts/brokers secure up` starts — a Kafka node with TLS,
//! SASL and ACLs enforced, TLS-only NATS servers with each way of signing in, a TLS-only
//! RabbitMQ node verifying client certificates — its URLs and test PKI, and conformance
//! factories whose consumers hold only what `reliq topology permissions` prints for them.
//!
//! Every such factory is a [`Secured`]: before a test's first connection it has its
//! [`Issuer`] grant (ACLs, a vhost's regexes) or mint (a NATS user) what the scenario's
//! consumers need for the test's topic, and from then on it is the plain factory on those
//! credentials.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::bail;
use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Broker, Subscription};

use crate::settings;

mod kafka;
mod nats;
mod rabbit;

pub use kafka::*;
pub use nats::*;
pub use rabbit::*;

/// `<repo>/.brokers/secure/pki` (or under `BROKERS_DIR`): the CA and the certificates.
pub fn pki() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::var_os("BROKERS_DIR")
        .map(PathBuf::from)
        .map_or_else(
            || root.join(".brokers"),
            |d| if d.is_absolute() { d } else { root.join(d) },
        );
    dir.join("secure").join("pki")
}

/// A file of the test PKI, as a URL value.
pub fn pki_file(name: &str) -> String {
    pki().join(name).to_string_lossy().into_owned()
}

fn port(key: &str) -> String {
    settings::get(key)
}

/// How a [`Secured`] factory gets ready for one test.
#[async_trait]
pub trait Issuer: Send + Sync + 'static {
    /// The backend's name.
    fn name(&self) -> &'static str;

    /// Grant or mint what the scenario's consumers need on `topic`, and return the plain
    /// factory that runs the scenario with those credentials. `timings` is the plain
    /// factory the secured one takes its tiers from (for the subscriptions to grant).
    async fn issue(&self, timings: &dyn Backend, topic: &str) -> anyhow::Result<Box<dyn Backend>>;
}

/// The subscriptions the scenario's `consumers` start on `topic` (what their grants are
/// computed from), as the conformance suite builds them.
pub fn scenario_subscriptions(
    timings: &dyn Backend,
    broker: &Arc<dyn Broker>,
    topic: &str,
    consumers: &[&str],
) -> anyhow::Result<Vec<Subscription>> {
    consumers
        .iter()
        .map(|name| {
            reliq_conformance::support::test_consumer(timings, broker.clone(), topic, name)
                .subscription()
                .map_err(anyhow::Error::from)
        })
        .collect()
}

/// A conformance factory that its [`Issuer`] prepares for each test (see the module
/// docs); the timings are the plain factory's.
pub struct Secured<I> {
    issuer: I,
    plain: Box<dyn Backend>,
    ready: OnceLock<Box<dyn Backend>>,
}

impl<I: Issuer> Secured<I> {
    fn with(issuer: I, plain: impl Backend + 'static) -> Self {
        Self {
            issuer,
            plain: Box::new(plain),
            ready: OnceLock::new(),
        }
    }

    fn ready(&self) -> &dyn Backend {
        self.ready
            .get()
            .expect("Ctx::new prepares the backend before it connects")
            .as_ref()
    }
}

#[async_trait]
impl<I: Issuer> Backend for Secured<I> {
    fn name(&self) -> &'static str {
        self.issuer.name()
    }

    async fn prepare(&self, topic: &str) -> anyhow::Result<()> {
        let ready = self.issuer.issue(self.plain.as_ref(), topic).await?;
        if self.ready.set(ready).is_err() {
            bail!("one backend per test: already prepared");
        }
        Ok(())
    }

    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>> {
        self.ready().connect().await
    }

    fn schema_registry(&self) -> String {
        self.plain.schema_registry()
    }

    fn tiers(&self) -> [Duration; 2] {
        self.plain.tiers()
    }

    fn tolerance(&self) -> Duration {
        self.plain.tolerance()
    }

    fn quiet_period(&self) -> Duration {
        self.plain.quiet_period()
    }

    fn crash_lease(&self) -> Duration {
        self.plain.crash_lease()
    }

    async fn declare_source(&self, broker: &Arc<dyn Broker>, topic: &str) -> anyhow::Result<()> {
        self.ready().declare_source(broker, topic).await
    }

    async fn set_dead_letter_available(
        &self,
        broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.ready()
            .set_dead_letter_available(broker, sub, available)
            .await
    }

    async fn set_retry_available(
        &self,
        broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.ready()
            .set_retry_available(broker, sub, available)
            .await
    }

    async fn unsettled(&self, broker: &Arc<dyn Broker>, sub: &Subscription) -> Option<usize> {
        self.ready().unsettled(broker, sub).await
    }

    async fn objects(
        &self,
        broker: &Arc<dyn Broker>,
        fragment: &str,
    ) -> anyhow::Result<Vec<String>> {
        self.ready().objects(broker, fragment).await
    }
}

/// How long a refused connection may take to fail: a refusal is not retried.
pub const REFUSED_WITHIN: Duration = Duration::from_secs(10);

/// `connecting` fails within [`REFUSED_WITHIN`], and its error, shown with its sources,
/// holds none of `secrets`; the error.
///
/// # Panics
/// When it connects, takes longer, or shows a secret (a test's assertion).
pub async fn refused<T>(
    connecting: impl std::future::Future<Output = Result<T, reliq_core::BrokerError>>,
    secrets: &[&str],
) -> reliq_core::BrokerError {
    let started = std::time::Instant::now();
    let Err(e) = connecting.await else {
        panic!("connected: a refusal was expected");
    };
    let text = reliq_core::ErrorChain(&e).to_string();
    assert!(
        started.elapsed() < REFUSED_WITHIN,
        "took {:?}: {text}",
        started.elapsed()
    );
    for s in secrets {
        assert!(!text.contains(s), "a secret in `{text}`");
    }
    e
}

/// The secured PostgreSQL cluster (TLS only) as the test role, with `sslmode` and the
/// root certificate `ca` (`ca` normally; `rogue-ca` to be refused).
pub fn postgres_url(sslmode: &str, ca: &str) -> String {
    format!(
        "postgres://{}:{}@127.0.0.1:{}/{}?sslmode={sslmode}&sslrootcert={}",
        settings::get("POSTGRES_USER"),
        settings::get("POSTGRES_PASSWORD"),
        port("POSTGRES_SECURE_PORT"),
        settings::get("POSTGRES_DB"),
        pki_file(&format!("{ca}.crt")),
    )
}

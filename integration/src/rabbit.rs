//! The RabbitMQ backend's conformance factory (the broker started by `scripts/brokers`).
//!
//! Fault hooks work on the real broker: "DLQ unavailable" deletes the consumer's
//! dead-letter stream (the confirmed, mandatory publish to it then comes back with
//! `basic.return`) and "restore" declares it again; "retry route broken" deletes the
//! consumer's TTL retry queues. Every queue is declared with `x-expires` so a test leaves
//! nothing behind; streams cannot expire, so the first connection of each test process
//! deletes the test streams whose landing queue has expired ([`sweep_orphan_streams`]).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_trait::async_trait;
use lapin::options::QueueDeleteOptions;
use lapin::{Connection, ConnectionProperties};
use reliq_conformance::Backend;
use reliq_core::{Broker, Subscription};
use reliq_rabbit::{Names, RabbitBroker, RabbitOptions};
use tokio::sync::OnceCell;

use crate::settings;

/// Fresh connections to the local RabbitMQ; names are made unique by the suite.
#[derive(Default)]
pub struct RabbitBackend {
    /// Another node or vhost than the plain node's `/` (the secured node).
    on: Option<Endpoint>,
    admin: OnceCell<(RabbitBroker, Option<Connection>)>,
}

/// Where a [`RabbitBackend`] made by [`RabbitBackend::on`] connects.
struct Endpoint {
    /// The admin's URL (declarations, fault hooks; with `reliq.management`).
    admin_url: String,
    /// What the scenario's consumers and publishes connect with.
    client_url: String,
    /// The vhost both URLs name.
    vhost: String,
}

impl RabbitBackend {
    /// A backend for one test.
    pub fn new() -> Self {
        Self::default()
    }

    /// A backend whose admin connects with `admin_url` and whose scenario connects with
    /// `client_url` (reliq URLs: `reliq.management`, TLS files and all), both on `vhost`.
    /// Its queues get the test options of [`RabbitBackend::options`] but no management
    /// API of their own on the client side, so no policy is needed.
    pub fn on(admin_url: &str, client_url: &str, vhost: &str) -> Self {
        Self {
            on: Some(Endpoint {
                admin_url: admin_url.to_owned(),
                client_url: client_url.to_owned(),
                vhost: vhost.to_owned(),
            }),
            admin: OnceCell::new(),
        }
    }

    /// A reliq connection from a URL with its options, and the test settings on top.
    pub async fn connect_url(url: &str) -> anyhow::Result<RabbitBroker> {
        let (stripped, options) = RabbitOptions::from_url(url)?;
        let options = RabbitOptions {
            queue_settings: reliq_rabbit::QueueSettings::Arguments,
            queue_expiry: Some(Duration::from_secs(600)),
            ..options
        };
        RabbitBroker::connect_with(&stripped, options)
            .await
            .with_context(|| format!("RabbitMQ at {}", reliq_core::seam::secrets::redact_url(url)))
    }

    fn vhost(&self) -> &str {
        self.on.as_ref().map_or("/", |e| e.vhost.as_str())
    }

    /// The options every test connection uses: quorum queues, management API for the
    /// version probe and the test hooks, settings as queue **arguments**, queues expire
    /// 10 minutes after their last use. Arguments, because per-queue policies do not
    /// expire with their queues and every policy change makes RabbitMQ re-match all
    /// queues: hundreds of parallel test queues would slow the management API down for
    /// everyone. The policy mode has its own tests ([`RabbitBackend::policy_options`]).
    pub fn options() -> RabbitOptions {
        RabbitOptions {
            management_url: Some(settings::get("RELIQ_RABBIT_MGMT_URL")),
            queue_settings: reliq_rabbit::QueueSettings::Arguments,
            queue_expiry: Some(Duration::from_secs(600)),
            ..RabbitOptions::default()
        }
    }

    /// [`RabbitBackend::options`] with the settings in policies (what a connection with
    /// a management URL does by default).
    pub fn policy_options() -> RabbitOptions {
        RabbitOptions {
            queue_settings: reliq_rabbit::QueueSettings::Policies,
            ..Self::options()
        }
    }

    /// A connection with [`RabbitBackend::policy_options`].
    pub async fn policy_broker() -> anyhow::Result<RabbitBroker> {
        let url = settings::get("RELIQ_RABBIT_URL");
        RabbitBroker::connect_with(&url, Self::policy_options())
            .await
            .with_context(|| format!("RabbitMQ at {url} (run scripts/brokers up)"))
    }

    /// A new reliq connection with [`RabbitBackend::options`].
    pub async fn broker() -> anyhow::Result<RabbitBroker> {
        let url = settings::get("RELIQ_RABBIT_URL");
        RabbitBroker::connect_with(&url, Self::options())
            .await
            .with_context(|| format!("RabbitMQ at {url} (run scripts/brokers up)"))
    }

    /// A shared admin connection: a reliq broker (declarations) and, on the plain node, a
    /// raw lapin connection (deletions; elsewhere they go through the management API).
    pub async fn admin(&self) -> anyhow::Result<&(RabbitBroker, Option<Connection>)> {
        self.admin
            .get_or_try_init(|| async {
                if let Some(e) = &self.on {
                    return Ok((Self::connect_url(&e.admin_url).await?, None));
                }
                let broker = Self::broker().await?;
                if let Some(api) = broker.management()
                    && let Err(e) = sweep_orphan_streams(api).await
                {
                    // Best-effort cleanup of earlier runs' leftovers (the next run sweeps
                    // again); not a warning: a busy management API answers 500 now and
                    // then, and the clean-log scenario must see only reliq's own.
                    tracing::info!(error = %e, "sweeping old test streams failed");
                }
                let raw = Connection::connect(
                    &settings::get("RELIQ_RABBIT_URL"),
                    ConnectionProperties::default(),
                )
                .await?;
                Ok::<_, anyhow::Error>((broker, Some(raw)))
            })
            .await
    }

    /// The admin's raw lapin connection (the plain node only).
    pub async fn raw(&self) -> anyhow::Result<&Connection> {
        self.admin()
            .await?
            .1
            .as_ref()
            .context("no raw connection on this node")
    }

    /// Delete a queue (whatever it holds).
    pub async fn delete_queue(&self, name: &str) -> anyhow::Result<()> {
        let (admin, raw) = self.admin().await?;
        let Some(raw) = raw else {
            let api = admin.management().context("no management URL")?;
            api.delete(&format!(
                "/api/queues/{}/{}",
                reliq_rabbit::encode_segment(self.vhost()),
                reliq_rabbit::encode_segment(name)
            ))
            .await?;
            return Ok(());
        };
        let ch = raw.create_channel().await?;
        ch.queue_delete(name.into(), QueueDeleteOptions::default())
            .await?;
        ch.close(200, "ok".into()).await?;
        Ok(())
    }

    /// A queue's counters from the management API.
    pub async fn queue_stats(&self, name: &str) -> anyhow::Result<serde_json::Value> {
        let (admin, _) = self.admin().await?;
        let mgmt = admin.management().context("no management URL")?;
        Ok(mgmt.queue(self.vhost(), name).await?)
    }
}

#[async_trait]
impl Backend for RabbitBackend {
    fn schema_registry(&self) -> String {
        crate::settings::get("RELIQ_SCHEMA_REGISTRY_URL")
    }

    fn name(&self) -> &'static str {
        "rabbit"
    }

    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>> {
        match &self.on {
            Some(e) => Ok(Arc::new(Self::connect_url(&e.client_url).await?)),
            None => Ok(Arc::new(Self::broker().await?)),
        }
    }

    fn tiers(&self) -> [Duration; 2] {
        [Duration::from_secs(1), Duration::from_secs(2)]
    }

    fn tolerance(&self) -> Duration {
        // TTL expiry on a quorum queue, dead-lettering through Raft, and redelivery.
        Duration::from_millis(1500)
    }

    fn quiet_period(&self) -> Duration {
        Duration::from_millis(1500)
    }

    async fn declare_source(&self, _broker: &Arc<dyn Broker>, topic: &str) -> anyhow::Result<()> {
        let (admin, _) = self.admin().await?;
        admin.declare_exchange(topic).await?;
        Ok(())
    }

    async fn set_dead_letter_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        if available {
            let (admin, _) = self.admin().await?;
            admin.declare_dead_letter_queue(sub).await?;
        } else {
            self.delete_queue(&Names::of(sub).parking).await?;
        }
        Ok(())
    }

    async fn set_retry_available(
        &self,
        _broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        if available {
            let (admin, _) = self.admin().await?;
            admin.declare_retry_queues(sub).await?;
        } else {
            for (_, queue) in Names::of(sub).retry {
                self.delete_queue(&queue).await?;
            }
        }
        Ok(())
    }

    async fn unsettled(&self, _broker: &Arc<dyn Broker>, sub: &Subscription) -> Option<usize> {
        let stats = self.queue_stats(&Names::of(sub).queue).await.ok()?;
        stats
            .get("messages_unacknowledged")
            .and_then(serde_json::Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
    }

    async fn objects(
        &self,
        _broker: &Arc<dyn Broker>,
        fragment: &str,
    ) -> anyhow::Result<Vec<String>> {
        let (admin, _) = self.admin().await?;
        let api = admin.management().context("no management URL")?;
        let vhost = reliq_rabbit::encode_segment(self.vhost());
        let mut names = Vec::new();
        for kind in ["queues", "exchanges"] {
            let list = api
                .get(&format!("/api/{kind}/{vhost}?columns=name"))
                .await?;
            names.extend(
                list.as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|o| o.get("name")?.as_str())
                    .filter(|n| n.contains(fragment))
                    .map(|n| format!("{kind}/{n}")),
            );
        }
        names.sort();
        Ok(names)
    }
}

/// Delete the dead-letter streams (and removal ledgers) of subscriptions whose landing
/// queue is gone: tests declare queues with `x-expires`, which streams reject, and the
/// landing queue is declared before its streams, so a stream without one is an orphan
/// of an expired test. Returns how many were deleted.
pub async fn sweep_orphan_streams(api: &reliq_rabbit::Management) -> anyhow::Result<usize> {
    let list = api.get("/api/queues/%2F?columns=name,type").await?;
    let queues: Vec<(&str, &str)> = list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|q| Some((q.get("name")?.as_str()?, q.get("type")?.as_str()?)))
        .collect();
    let names: std::collections::HashSet<&str> = queues.iter().map(|(n, _)| *n).collect();
    let mut deleted = 0;
    for (name, kind) in &queues {
        let landing = name
            .strip_suffix(".stream")
            .or_else(|| name.strip_suffix(".removed"))
            .filter(|l| l.ends_with(".dlq"));
        if *kind == "stream"
            && let Some(landing) = landing
            && !names.contains(landing)
        {
            api.delete(&format!(
                "/api/queues/%2F/{}",
                reliq_rabbit::encode_segment(name)
            ))
            .await?;
            deleted += 1;
        }
    }
    Ok(deleted)
}

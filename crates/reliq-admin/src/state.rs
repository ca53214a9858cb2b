//! What the admin server serves from ([`AdminState`]), and what a handler tells the
//! audit middleware ([`AuditNote`]): shared by the API (`http`) and the console.

use std::sync::Arc;

use reliq_core::{Broker, Subscription};

use crate::audit::AuditLog;
use crate::auth::{Principal, Tokens};
use crate::filter::FilterSpec;
use crate::jobs::Jobs;
use crate::sessions::Sessions;
use crate::throttle::{AuthBudget, AuthThrottle};

/// What the API serves from.
pub struct AdminState {
    pub(crate) broker: Arc<dyn Broker>,
    pub(crate) tokens: Tokens,
    pub(crate) audit: Arc<AuditLog>,
    pub(crate) jobs: Jobs,
    /// The consumers the console lists and the metrics poller reads, with their retry
    /// tiers (the broker's tier routes are named by them).
    pub(crate) consumers: Vec<Subscription>,
    pub(crate) sessions: Sessions,
    pub(crate) secure_cookies: bool,
    /// The Prometheus recorder's handle, rendered at `GET /metrics`.
    pub(crate) metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    /// Failed authentications per client address.
    pub(crate) throttle: AuthThrottle,
    /// How long `/readyz` waits for the broker's answer.
    pub(crate) ready_timeout: std::time::Duration,
    /// Operators' triage of failure groups, when the server keeps it.
    pub(crate) triage: Option<crate::triage::TriageStore>,
    /// Single sign-on for the console, when configured.
    pub(crate) oidc: Option<crate::oidc::Oidc>,
    /// Decodes registry-framed dead letters for display and re-encodes corrected ones.
    pub(crate) registry: Option<Arc<reliq_contracts::SchemaRegistry>>,
}

impl std::fmt::Debug for AdminState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState")
            .field("broker", &self.broker.kind())
            .field("jobs", &self.jobs)
            .finish_non_exhaustive()
    }
}

impl AdminState {
    /// Serve `broker`'s DLQs to the holders of `tokens`, auditing to `audit`.
    pub fn new(broker: Arc<dyn Broker>, tokens: Tokens, audit: AuditLog) -> Self {
        Self {
            broker,
            tokens,
            audit: Arc::new(audit),
            jobs: Jobs::default(),
            consumers: Vec::new(),
            sessions: Sessions::default(),
            secure_cookies: false,
            metrics: None,
            throttle: AuthThrottle::new(AuthBudget::default()),
            ready_timeout: std::time::Duration::from_secs(3),
            triage: None,
            oidc: None,
            registry: None,
        }
    }

    /// How many failed authentications a client address may make before it is answered
    /// 429 (default: 10 at once, then one every 6 s).
    pub fn with_auth_budget(mut self, budget: AuthBudget) -> Self {
        self.throttle = AuthThrottle::new(budget);
        self
    }

    /// Show registry-framed dead letters decoded with their writer's schema (the API's
    /// entry, the console's message page) and let an edit send a corrected value as JSON,
    /// written back with that schema.
    pub fn with_schema_registry(mut self, registry: Arc<reliq_contracts::SchemaRegistry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// The DLQ of `subscription`'s consumer, with this server's schema registry.
    pub(crate) fn dlq(
        &self,
        subscription: Subscription,
    ) -> Result<crate::ops::Dlq, crate::error::AdminError> {
        let dlq = crate::ops::Dlq::new(self.broker.clone(), subscription)?;
        Ok(match &self.registry {
            Some(registry) => dlq.with_schema_registry(registry.clone()),
            None => dlq,
        })
    }

    /// The consumers the console's overview lists: each one's subscription as its
    /// consumer makes it (source, and the retry tiers its policy declares), e.g. from
    /// [`parse_consumer`](crate::http::parse_consumer).
    pub fn with_consumers(mut self, consumers: impl IntoIterator<Item = Subscription>) -> Self {
        self.consumers = consumers.into_iter().collect();
        self
    }

    /// Serve `handle`'s metrics at `GET /metrics` (Prometheus text; a reader token, as a
    /// bearer: Prometheus' `authorization` scrape setting).
    pub fn with_metrics(mut self, handle: metrics_exporter_prometheus::PrometheusHandle) -> Self {
        self.metrics = Some(handle);
        self
    }

    /// How long `GET /readyz` waits for the broker to answer before it says 503
    /// (default 3 s; keep it under the probe's own timeout).
    pub fn with_ready_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// Keep operators' triage of failure groups in `store` (status, assignee, notes):
    /// the triage endpoints and the console's triage form; `stats` then leaves archived
    /// groups out unless asked (`?archived=true`).
    pub fn with_triage(mut self, store: crate::triage::TriageStore) -> Self {
        self.triage = Some(store);
        self
    }

    /// Let people sign in to the console through an OpenID provider (beside tokens,
    /// which the API keeps using).
    pub fn with_oidc(mut self, oidc: crate::oidc::Oidc) -> Self {
        self.oidc = Some(oidc);
        self
    }

    /// The triage store, or [`AdminError::TriageOff`](crate::error::AdminError) when the
    /// server keeps none.
    pub(crate) fn triage_store(
        &self,
    ) -> Result<&crate::triage::TriageStore, crate::error::AdminError> {
        self.triage
            .as_ref()
            .ok_or(crate::error::AdminError::TriageOff)
    }

    /// `stats` with each group's triage, archived groups left out unless
    /// `include_archived` (unchanged when the server keeps no triage).
    pub(crate) async fn triaged_stats(
        &self,
        stats: Result<crate::ops::DlqStats, crate::error::AdminError>,
        include_archived: bool,
    ) -> Result<crate::ops::DlqStats, crate::error::AdminError> {
        let mut stats = stats?;
        if let Some(store) = &self.triage {
            let triage = store.statuses(&stats.consumer).await?;
            stats.annotate(&triage, include_archived);
        }
        Ok(stats)
    }

    /// The server's jobs (for [`Jobs::drain`](crate::jobs::Jobs::drain) at shutdown).
    pub fn jobs(&self) -> &Jobs {
        &self.jobs
    }

    /// Mark the console's session cookie `Secure`: the server is reached over TLS (a
    /// terminating proxy in front of it).
    pub fn secure_cookies(mut self, secure: bool) -> Self {
        self.secure_cookies = secure;
        self
    }
}

/// What a handler tells the audit middleware about its request.
#[derive(Clone, Debug, Default)]
pub(crate) struct AuditNote {
    pub(crate) actor: Option<Principal>,
    pub(crate) action: &'static str,
    pub(crate) consumer: Option<String>,
    pub(crate) filter: Option<FilterSpec>,
    pub(crate) reason: Option<String>,
    pub(crate) counts: Option<serde_json::Value>,
    pub(crate) job: Option<String>,
    /// What a change changed (a triage change: the group and the fields set).
    pub(crate) detail: Option<serde_json::Value>,
    /// Not audited when allowed: a scrape every few seconds would drown the log (a
    /// refused one is still written).
    pub(crate) quiet: bool,
    /// Not audited at all: a throttled address's 429 (counted into the block's summary
    /// record instead).
    pub(crate) unaudited: bool,
}

impl AdminState {
    /// The AsyncAPI 3.0 document of the consumers this server operates: each one's
    /// source, retry and dead-letter channels, from the broker's plan (creates nothing).
    /// Payloads are bytes here: the codecs are the services' own.
    pub(crate) async fn asyncapi(&self) -> Result<serde_json::Value, crate::error::AdminError> {
        let mut doc = reliq_core::AsyncApi::new("reliq consumers", env!("CARGO_PKG_VERSION"))
            .description(format!(
                "The consumers a reliq admin server operates on {}: each one's source, \
                 retry channels and dead-letter channel, with reliq's dead-letter record.",
                self.broker.kind()
            ));
        for subscription in &self.consumers {
            doc = doc.consumer(self.broker.plan(subscription).await?, None);
        }
        Ok(doc.to_json())
    }
}

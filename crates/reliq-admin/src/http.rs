//! The admin HTTP API: the operations of [`crate::ops::Dlq`] as versioned JSON endpoints,
//! behind bearer tokens with roles, every request written to the audit log.
//!
//! | Method and path | Role | What |
//! |---|---|---|
//! | `GET /v1/openapi.json` | — | this API as an OpenAPI 3.1 document |
//! | `GET /healthz` | — | 200 while the process serves (liveness; not audited) |
//! | `GET /readyz` | — | 200 when the broker answered a ping within the ready timeout, 503 when not or while the server drains (readiness; not audited) |
//! | `GET /metrics` | reader | Prometheus text: reliq's metrics and the broker-side gauges of the server's consumers (a scrape is audited only when refused) |
//! | `GET /v1/consumers/{consumer}/dlq/stats?source=…&<filter>` | reader | [`crate::ops::DlqStats`] |
//! | `GET /v1/consumers/{consumer}/dlq/entries?source=…&<filter>&cursor=…&max=…` | reader | [`crate::ops::EntryList`] |
//! | `GET /v1/consumers/{consumer}/dlq/entries/{id}?source=…` | reader | [`crate::ops::EntryDetail`] |
//! | `POST /v1/consumers/{consumer}/dlq/replay?source=…` | operator | body [`crate::ops::ReplayRequest`]; a dry run answers 200 with the [`crate::ops::RunOutcome`], a replay 202 with its job |
//! | `POST /v1/consumers/{consumer}/dlq/entries/{id}/edit?source=…` | operator | body `{"payload": <JSON>}` or `{"payload_base64": "…"}`, `"headers": ["k=v"]`; [`crate::ops::EditOutcome`] |
//! | `POST /v1/consumers/{consumer}/dlq/purge?source=…` | admin | body [`crate::ops::PurgeRequest`]; a dry run answers 200, a purge 202 with its job |
//! | `GET /v1/jobs`, `GET /v1/jobs/{id}` | reader | [`crate::jobs::JobView`]s |
//! | `POST /v1/jobs/{id}/cancel` | operator | the job, asked to stop |
//!
//! The web console's pages are under `/console/` (see the `console` module's docs).
//!
//! `<filter>` is [`crate::filter::FilterSpec`]'s fields as query parameters (lists repeat or are
//! comma-separated). Errors are `{"error": "…"}` with 400 (bad input, naming the field),
//! 401 (no, wrong, removed or expired token), 403 (a role that may not), 404, 413 (body
//! over the limit), 429 (too many failed authentications from the client's address, with
//! `Retry-After`: see [`crate::AuthBudget`]), 502/503 (the broker).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use reliq_core::{Cursor, Subscription};
use serde::Deserialize;
use tower_http::set_header::SetResponseHeaderLayer;

use crate::audit::AuditRecord;
use crate::auth::Role;
use crate::error::AdminError;
use crate::filter::FilterSpec;
use crate::jobs::Jobs;
use crate::ops::{Dlq, EditRequest, Run};
pub use crate::state::AdminState;
use crate::state::AuditNote;

/// The OpenAPI document served at `/v1/openapi.json`.
pub const OPENAPI: &str = include_str!("openapi.json");

/// Every route: method, path, the least role it needs (`None`: no token needed).
pub const ROUTES: &[(&str, &str, Option<Role>)] = &[
    ("GET", "/v1/openapi.json", None),
    ("GET", "/v1/asyncapi.json", Some(Role::Reader)),
    ("GET", "/healthz", None),
    ("GET", "/readyz", None),
    ("GET", "/metrics", Some(Role::Reader)),
    (
        "GET",
        "/v1/consumers/{consumer}/dlq/stats",
        Some(Role::Reader),
    ),
    (
        "GET",
        "/v1/consumers/{consumer}/dlq/entries",
        Some(Role::Reader),
    ),
    (
        "GET",
        "/v1/consumers/{consumer}/dlq/entries/{id}",
        Some(Role::Reader),
    ),
    (
        "POST",
        "/v1/consumers/{consumer}/dlq/replay",
        Some(Role::Operator),
    ),
    (
        "GET",
        "/v1/consumers/{consumer}/dlq/groups/{fingerprint}/triage",
        Some(Role::Reader),
    ),
    (
        "PUT",
        "/v1/consumers/{consumer}/dlq/groups/{fingerprint}/triage",
        Some(Role::Operator),
    ),
    (
        "POST",
        "/v1/consumers/{consumer}/dlq/entries/{id}/edit",
        Some(Role::Operator),
    ),
    (
        "POST",
        "/v1/consumers/{consumer}/dlq/purge",
        Some(Role::Admin),
    ),
    ("GET", "/v1/jobs", Some(Role::Reader)),
    ("GET", "/v1/jobs/{id}", Some(Role::Reader)),
    ("POST", "/v1/jobs/{id}/cancel", Some(Role::Operator)),
];

/// Limits of the API.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest request body accepted, bytes (413 beyond).
    pub max_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
        }
    }
}

/// The API's router. Serve it with [`crate::serve`], or with
/// `axum::serve(listener, router.into_make_service_with_connect_info::<SocketAddr>())` so
/// the audit log records peers.
pub fn router(state: Arc<AdminState>, limits: Limits) -> Router {
    let routes = Router::new()
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/asyncapi.json", get(asyncapi))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/v1/consumers/{consumer}/dlq/stats", get(stats))
        .route("/v1/consumers/{consumer}/dlq/entries", get(list))
        .route("/v1/consumers/{consumer}/dlq/entries/{id}", get(show))
        .route("/v1/consumers/{consumer}/dlq/replay", post(replay))
        .route("/v1/consumers/{consumer}/dlq/entries/{id}/edit", post(edit))
        .route("/v1/consumers/{consumer}/dlq/purge", post(purge))
        .route(
            "/v1/consumers/{consumer}/dlq/groups/{fingerprint}/triage",
            get(triage).put(change_triage),
        )
        .route("/v1/jobs", get(jobs))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/jobs/{id}/cancel", post(cancel_job))
        .merge(crate::console::routes())
        .layer(DefaultBodyLimit::max(limits.max_body_bytes));
    // Sign-out may send the browser on to the identity provider's own sign-out: a
    // redirect after a form post, which `form-action` governs too.
    let policy = match &state.oidc {
        Some(oidc) => CONTENT_SECURITY_POLICY.replace(
            "form-action 'self'",
            &format!("form-action 'self' {}", oidc.provider_origin()),
        ),
        None => CONTENT_SECURITY_POLICY.to_owned(),
    };
    let policy =
        HeaderValue::from_str(&policy).unwrap_or(HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    let hardened = BROWSER_HARDENING
        .into_iter()
        .map(|(name, value)| match name {
            header::CONTENT_SECURITY_POLICY => (name, policy.clone()),
            _ => (name, HeaderValue::from_static(value)),
        })
        .fold(routes, |r, (name, value)| {
            r.layer(SetResponseHeaderLayer::overriding(name, value))
        });
    metrics::describe_counter!(
        crate::throttle::REFUSED_REQUESTS,
        metrics::Unit::Count,
        "Requests the admin server refused (by reason: unauthorized, forbidden, throttled)."
    );
    hardened
        .layer(middleware::from_fn_with_state(
            state.clone(),
            throttle_failed_auth,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            audit_every_request,
        ))
        .with_state(state)
}

/// What every response tells a browser, on the console's pages and the API alike (an
/// error page or a refusal too): run no script at all and load nothing from elsewhere
/// (the console is plain HTML forms and one stylesheet of its own), post forms only back
/// here, never be framed (clickjacking), take no content type but the one sent, and send
/// no referrer (the console's URLs name consumers and message ids).
const BROWSER_HARDENING: [(header::HeaderName, &str); 4] = [
    (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
    (header::X_FRAME_OPTIONS, "DENY"),
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    (header::REFERRER_POLICY, "no-referrer"),
];

/// The console's content security policy: nothing but its own stylesheet and images, no
/// script (inline or not), forms to itself, no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; \
     img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// The client's address, when the router is served with connect info (`serve` does).
fn peer(request: &Request) -> Option<SocketAddr> {
    request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0)
}

/// The middleware: refuses a blocked address before anything else runs, and counts the
/// failed authentications of the others.
async fn throttle_failed_auth(
    State(state): State<Arc<AdminState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(addr) = peer(&request).map(|p| p.ip()) else {
        // No peer address (a router served without connect info): nothing to key on.
        return next.run(request).await;
    };
    let now = Instant::now();
    if let Some(wait) = state.throttle.refuse(addr, now) {
        metrics::counter!(crate::throttle::REFUSED_REQUESTS, "reason" => "throttled").increment(1);
        return throttled(wait);
    }
    if let Some(unaudited) = state.throttle.ended(addr, now)
        && unaudited > 0
    {
        state.audit.write(AuditRecord {
            remote: Some(addr.to_string()),
            request: "(throttled requests)".into(),
            action: "throttled".into(),
            outcome: "refused",
            status: 429,
            reason: Some(format!(
                "{unaudited} more request(s) refused while throttled after too many failed \
                 authentications"
            )),
            ..AuditRecord::default()
        });
    }
    let response = next.run(request).await;
    match response.status() {
        StatusCode::UNAUTHORIZED => {
            metrics::counter!(crate::throttle::REFUSED_REQUESTS, "reason" => "unauthorized")
                .increment(1);
            if state.throttle.failed(addr, now) {
                tracing::warn!(remote = %addr, "too many failed authentications; address throttled");
            }
        }
        StatusCode::FORBIDDEN => {
            metrics::counter!(crate::throttle::REFUSED_REQUESTS, "reason" => "forbidden")
                .increment(1);
        }
        _ => {}
    }
    response
}

/// The 429 answer, kept out of the audit log (the block's summary record counts it).
fn throttled(wait: Duration) -> Response {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let mut response = (
        StatusCode::TOO_MANY_REQUESTS,
        axum::Json(serde_json::json!({
            "error": "too many failed authentications from this address; try again later"
        })),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&seconds.to_string()) {
        response.headers_mut().insert(header::RETRY_AFTER, v);
    }
    response.extensions_mut().insert(AuditNote {
        action: "throttled",
        reason: Some("too many failed authentications".into()),
        unaudited: true,
        ..AuditNote::default()
    });
    response
}

/// Writes one audit record per request, whatever answered it (a handler, a refused
/// token, a body over the limit, an unknown path), with the handler's note when it left one.
async fn audit_every_request(
    State(state): State<Arc<AdminState>>,
    request: Request,
    next: Next,
) -> Response {
    let remote = peer(&request).map(|p| p.to_string());
    let line = format!("{} {}", request.method(), request.uri().path());
    let mut response = next.run(request).await;
    let note = response
        .extensions_mut()
        .remove::<AuditNote>()
        .unwrap_or_default();
    let status = response.status().as_u16();
    if note.unaudited || (note.quiet && status < 400) {
        return response;
    }
    let outcome = match status {
        s if s < 400 => "allowed",
        401 | 403 | 413 => "refused",
        _ => "failed",
    };
    state.audit.write(AuditRecord {
        actor: note.actor.as_ref().map(|p| p.name.clone()),
        role: note.actor.as_ref().map(|p| p.role.as_str()),
        remote,
        request: line,
        action: if note.action.is_empty() {
            "unknown".into()
        } else {
            note.action.into()
        },
        consumer: note.consumer,
        filter: note.filter,
        outcome,
        status,
        reason: note.reason,
        counts: note.counts,
        job: note.job,
        detail: note.detail,
        ..AuditRecord::default()
    });
    response
}

/// A JSON answer carrying its audit note.
struct Reply {
    status: StatusCode,
    body: serde_json::Value,
    note: Box<AuditNote>,
}

impl IntoResponse for Reply {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body)).into_response();
        response.extensions_mut().insert(*self.note);
        response
    }
}

impl Reply {
    fn ok(note: AuditNote, body: impl serde::Serialize) -> Self {
        Self::with_status(StatusCode::OK, note, body)
    }

    fn with_status(status: StatusCode, note: AuditNote, body: impl serde::Serialize) -> Self {
        match serde_json::to_value(body) {
            Ok(body) => Self {
                status,
                body,
                note: Box::new(note),
            },
            Err(e) => Self::error(note, StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }

    fn error(mut note: AuditNote, status: StatusCode, message: String) -> Self {
        note.reason = Some(message.clone());
        Self {
            status,
            body: serde_json::json!({ "error": message }),
            note: Box::new(note),
        }
    }

    fn failed(note: AuditNote, e: AdminError) -> Self {
        let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Self::error(note, status, e.to_string())
    }
}

/// Check the bearer token for `role`; the note to go on with, or the refusal.
fn authorize(
    state: &AdminState,
    headers: &HeaderMap,
    role: Role,
    mut note: AuditNote,
) -> Result<AuditNote, Reply> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match state.tokens.check(bearer, SystemTime::now()) {
        Err(refusal) => Err(Reply::error(
            note,
            StatusCode::UNAUTHORIZED,
            refusal.as_str().into(),
        )),
        Ok(principal) if principal.role < role => {
            let why = format!(
                "role `{}` may not {} (needs `{}`)",
                principal.role.as_str(),
                note.action,
                role.as_str()
            );
            note.actor = Some(principal);
            Err(Reply::error(note, StatusCode::FORBIDDEN, why))
        }
        Ok(principal) => {
            note.actor = Some(principal);
            Ok(note)
        }
    }
}

/// A consumer as `reliq admin serve --consumer` takes it: `NAME=SOURCE`, then
/// optionally `@` and its retry tiers as its policy has them (`billing=orders@1s,30s,5m`),
/// which the backlog of Kafka's retry topics and RabbitMQ's TTL queues needs (they are
/// named by their delay).
pub fn parse_consumer(spec: &str) -> Result<Subscription, AdminError> {
    let bad = |expected: &str| AdminError::InvalidInput {
        field: "consumer",
        value: spec.chars().take(80).collect(),
        expected: expected.to_owned(),
    };
    let (consumer, rest) = spec
        .split_once('=')
        .ok_or_else(|| bad("NAME=SOURCE[@TIER,TIER…], e.g. billing=orders@1s,30s"))?;
    let (source, tiers) = match rest.split_once('@') {
        Some((source, tiers)) => (source, Some(tiers)),
        None => (rest, None),
    };
    if consumer.is_empty() || source.is_empty() {
        return Err(bad("a consumer name and a source: NAME=SOURCE"));
    }
    let mut sub = Subscription::new(consumer, source);
    sub.check_names()?;
    if let Some(tiers) = tiers {
        sub.retry_tiers = tiers
            .split(',')
            .map(|t| humantime::parse_duration(t.trim()))
            .collect::<Result<_, _>>()
            .map_err(|e| bad(&format!("retry tiers as durations (1s,30s,5m): {e}")))?;
    }
    Ok(sub)
}

/// The query string's pairs; `source` taken out and required.
fn query(raw: Option<String>) -> Result<(String, Vec<(String, String)>), AdminError> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| AdminError::InvalidInput {
            field: "query",
            value: String::new(),
            expected: e.to_string(),
        })?;
    let source = pairs
        .iter()
        .find(|(k, _)| k == "source")
        .map(|(_, v)| v.clone())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| AdminError::InvalidInput {
            field: "source",
            value: String::new(),
            expected: "the consumer's source (topic, exchange, stream or queue) as ?source=…"
                .into(),
        })?;
    Ok((source, pairs))
}

fn dlq(state: &AdminState, consumer: &str, source: String) -> Result<Dlq, AdminError> {
    state.dlq(Subscription::new(consumer, source))
}

/// What a DLQ endpoint goes on with once its caller may: the audit note, the DLQ, the
/// query's pairs.
struct Begun {
    note: AuditNote,
    dlq: Dlq,
    pairs: Vec<(String, String)>,
}

/// Everything a DLQ endpoint starts with: the note, the role check, the source.
fn begin(
    state: &AdminState,
    headers: &HeaderMap,
    role: Role,
    action: &'static str,
    consumer: &str,
    raw_query: Option<String>,
) -> Result<Begun, Reply> {
    let note = AuditNote {
        action,
        consumer: Some(consumer.to_owned()),
        ..AuditNote::default()
    };
    let note = authorize(state, headers, role, note)?;
    match query(raw_query).and_then(|(source, pairs)| Ok((dlq(state, consumer, source)?, pairs))) {
        Ok((dlq, pairs)) => Ok(Begun { note, dlq, pairs }),
        Err(e) => Err(Reply::failed(note, e)),
    }
}

/// [`begin`] for a reader's endpoint that takes the filter from the query string: the
/// filter parsed (and noted for the audit log) too.
fn begin_filtered(
    state: &AdminState,
    headers: &HeaderMap,
    action: &'static str,
    consumer: &str,
    raw_query: Option<String>,
) -> Result<(Begun, FilterSpec), Reply> {
    let mut begun = begin(state, headers, Role::Reader, action, consumer, raw_query)?;
    match FilterSpec::from_pairs(&begun.pairs) {
        Ok(spec) => {
            begun.note.filter = Some(spec.clone());
            Ok((begun, spec))
        }
        Err(e) => Err(Reply::failed(begun.note, e)),
    }
}

async fn openapi() -> Response {
    let mut response = ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response();
    response.extensions_mut().insert(AuditNote {
        action: "openapi",
        ..AuditNote::default()
    });
    response
}

/// `GET /v1/asyncapi.json`: the AsyncAPI document of the server's consumers (a reader).
async fn asyncapi(State(state): State<Arc<AdminState>>, headers: HeaderMap) -> Reply {
    let note = AuditNote {
        action: "asyncapi",
        ..AuditNote::default()
    };
    let note = match authorize(&state, &headers, Role::Reader, note) {
        Ok(note) => note,
        Err(reply) => return reply,
    };
    match state.asyncapi().await {
        Ok(doc) => Reply::ok(note, doc),
        Err(e) => Reply::failed(note, e),
    }
}

/// `GET /healthz`: the process is up and serving (a liveness probe: it asks nobody).
async fn healthz() -> Response {
    probe_answer(StatusCode::OK, serde_json::json!({ "status": "alive" }))
}

/// `GET /readyz`: the broker answered a [`ping`](reliq_core::Broker::ping) within the
/// ready timeout, and the server is not draining. The reason of a 503 names the error's
/// kind only (the probe needs no token; the details go to the log).
async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
    let broker = state.broker.kind();
    if state.jobs.is_draining() {
        return probe_answer(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({ "status": "draining", "broker": broker }),
        );
    }
    let unready = |reason: String| {
        probe_answer(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({ "status": "unready", "broker": broker, "reason": reason }),
        )
    };
    match tokio::time::timeout(state.ready_timeout, state.broker.ping()).await {
        Ok(Ok(())) => probe_answer(
            StatusCode::OK,
            serde_json::json!({ "status": "ready", "broker": broker }),
        ),
        Ok(Err(e)) => {
            tracing::warn!(error = %reliq_core::ErrorChain(&e), "readiness: the broker's ping failed");
            unready(format!("the broker's ping failed ({})", e.kind()))
        }
        Err(_) => {
            tracing::warn!(timeout = ?state.ready_timeout, "readiness: the broker did not answer its ping");
            unready(format!(
                "the broker did not answer within {}",
                humantime::format_duration(state.ready_timeout)
            ))
        }
    }
}

/// A probe's answer: JSON, never cached, never audited (probes come every few seconds).
fn probe_answer(status: StatusCode, body: serde_json::Value) -> Response {
    let mut response = (
        status,
        [(header::CACHE_CONTROL, "no-store")],
        axum::Json(body),
    )
        .into_response();
    response.extensions_mut().insert(AuditNote {
        action: "probe",
        unaudited: true,
        ..AuditNote::default()
    });
    response
}

/// `GET /metrics`: the process's metrics (reliq's, the backlog poller's, the
/// application's) in Prometheus' text format.
async fn metrics_text(State(state): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    let note = AuditNote {
        action: "metrics",
        quiet: true,
        ..AuditNote::default()
    };
    let note = match authorize(&state, &headers, Role::Reader, note) {
        Ok(note) => note,
        Err(reply) => return reply.into_response(),
    };
    let Some(handle) = &state.metrics else {
        return Reply::error(
            note,
            StatusCode::NOT_FOUND,
            "this server has no metrics recorder (AdminState::with_metrics)".into(),
        )
        .into_response();
    };
    let mut response = (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
        .into_response();
    response.extensions_mut().insert(note);
    response
}

async fn stats(
    State(state): State<Arc<AdminState>>,
    Path(consumer): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Reply {
    let (
        Begun {
            mut note,
            dlq,
            pairs,
        },
        spec,
    ) = match begin_filtered(&state, &headers, "stats", &consumer, raw) {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let include_archived = pairs.iter().any(|(k, v)| k == "archived" && v == "true");
    match state
        .triaged_stats(dlq.stats(&spec).await, include_archived)
        .await
    {
        Ok(stats) => {
            note.counts = Some(serde_json::json!({ "matched": stats.count }));
            Reply::ok(note, stats)
        }
        Err(e) => Reply::failed(note, e),
    }
}

/// `GET …/groups/{fingerprint}/triage`: a group's status, assignee and notes (a reader).
async fn triage(
    State(state): State<Arc<AdminState>>,
    Path((consumer, fingerprint)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Reply {
    let Begun { note, .. } = match begin(
        &state,
        &headers,
        Role::Reader,
        "triage-show",
        &consumer,
        raw,
    ) {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let read = async { state.triage_store()?.get(&consumer, &fingerprint).await };
    match read.await {
        Ok(t) => Reply::ok(note, t),
        Err(e) => Reply::failed(note, e),
    }
}

/// `PUT …/groups/{fingerprint}/triage`: set the status or assignee, add a note (an
/// operator); the change is in the audit record's `detail`.
async fn change_triage(
    State(state): State<Arc<AdminState>>,
    Path((consumer, fingerprint)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    bytes: axum::body::Bytes,
) -> Reply {
    let Begun { mut note, .. } =
        match begin(&state, &headers, Role::Operator, "triage", &consumer, raw) {
            Ok(b) => b,
            Err(reply) => return reply,
        };
    let change: crate::triage::TriageChange = match body(&note, &bytes) {
        Ok(c) => c,
        Err(reply) => return reply,
    };
    let store = match state.triage_store() {
        Ok(store) => store,
        Err(e) => return Reply::failed(note, e),
    };
    let actor = note
        .actor
        .as_ref()
        .map_or("-", |p| p.name.as_str())
        .to_owned();
    note.detail = Some(change.audit_detail(&fingerprint));
    match store.change(&consumer, &fingerprint, &actor, &change).await {
        Ok(t) => Reply::ok(note, t),
        Err(e) => Reply::failed(note, e),
    }
}

async fn list(
    State(state): State<Arc<AdminState>>,
    Path(consumer): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Reply {
    let (
        Begun {
            mut note,
            dlq,
            pairs,
        },
        spec,
    ) = match begin_filtered(&state, &headers, "ls", &consumer, raw) {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let value = |name: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let cursor = Cursor::from(value("cursor").unwrap_or_default());
    let max = match value("max").map(|m| m.parse::<usize>()) {
        None => 100,
        Some(Ok(m)) if (1..=crate::ops::MAX_LIST).contains(&m) => m,
        Some(_) => {
            let e = AdminError::InvalidInput {
                field: "max",
                value: value("max").unwrap_or_default(),
                expected: format!("a whole number from 1 to {}", crate::ops::MAX_LIST),
            };
            return Reply::failed(note, e);
        }
    };
    match dlq.list(&spec, &cursor, max).await {
        Ok(page) => {
            note.counts = Some(serde_json::json!({ "listed": page.entries.len() }));
            Reply::ok(note, page)
        }
        Err(e) => Reply::failed(note, e),
    }
}

async fn show(
    State(state): State<Arc<AdminState>>,
    Path((consumer, id)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Reply {
    let Begun { note, dlq, .. } =
        match begin(&state, &headers, Role::Reader, "show", &consumer, raw) {
            Ok(b) => b,
            Err(reply) => return reply,
        };
    match dlq.show(&id).await {
        Ok(detail) => Reply::ok(note, detail),
        Err(e) => Reply::failed(note, e),
    }
}

/// A JSON body, or the reply refusing it.
fn body<T: serde::de::DeserializeOwned + Default>(
    note: &AuditNote,
    bytes: &[u8],
) -> Result<T, Reply> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes).map_err(|e| {
        Reply::failed(
            note.clone(),
            AdminError::InvalidInput {
                field: "body",
                value: String::new(),
                expected: format!("a JSON object as documented: {e}"),
            },
        )
    })
}

async fn replay(
    State(state): State<Arc<AdminState>>,
    Path(consumer): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    bytes: axum::body::Bytes,
) -> Reply {
    let parse = |note: &AuditNote| body(note, &bytes).map(Run::Replay);
    start_run(
        &state,
        &consumer,
        raw,
        &headers,
        Role::Operator,
        "replay",
        parse,
    )
    .await
}

async fn purge(
    State(state): State<Arc<AdminState>>,
    Path(consumer): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    bytes: axum::body::Bytes,
) -> Reply {
    let parse = |note: &AuditNote| body(note, &bytes).map(Run::Purge);
    start_run(
        &state,
        &consumer,
        raw,
        &headers,
        Role::Admin,
        "purge",
        parse,
    )
    .await
}

/// A replay or purge: a dry run answers at once (200, the outcome), a run starts a job
/// (202, the job to poll).
async fn start_run(
    state: &Arc<AdminState>,
    consumer: &str,
    raw: Option<String>,
    headers: &HeaderMap,
    role: Role,
    action: &'static str,
    parse: impl FnOnce(&AuditNote) -> Result<Run, Reply>,
) -> Reply {
    let Begun { mut note, dlq, .. } = match begin(state, headers, role, action, consumer, raw) {
        Ok(b) => b,
        Err(reply) => return reply,
    };
    let run = match parse(&note) {
        Ok(r) => r,
        Err(reply) => return reply,
    };
    note.filter = Some(run.filter().clone());
    if let Err(e) = run.filter().to_filter(SystemTime::now()) {
        return Reply::failed(note, e);
    }
    if run.dry_run() {
        note.action = match run {
            Run::Replay(_) => "replay-dry-run",
            Run::Purge(_) => "purge-dry-run",
        };
        return match dlq.run(&run, |_| {}, Default::default()).await {
            Ok(outcome) => {
                note.counts = Some(serde_json::json!({ "matched": outcome.matched }));
                Reply::ok(note, outcome)
            }
            Err(e) => Reply::failed(note, e),
        };
    }
    let actor = note
        .actor
        .as_ref()
        .map(|p| p.name.clone())
        .unwrap_or_default();
    let filter = run.filter().clone();
    let job = state.jobs.spawn(
        run.operation(),
        consumer,
        &actor,
        &filter,
        state.audit.clone(),
        |ctx| async move { dlq.run(&run, ctx.progress(), ctx.cancel()).await },
    );
    let job = match job {
        Ok(job) => job,
        Err(e) => return Reply::failed(note, e),
    };
    note.job = Some(job.id.clone());
    Reply::with_status(StatusCode::ACCEPTED, note, job)
}

/// The body of an edit.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct EditBody {
    /// The corrected payload as JSON (sent as its compact serialization).
    payload: Option<serde_json::Value>,
    /// The corrected payload's bytes, base64 (for payloads that are not JSON).
    payload_base64: Option<String>,
    /// The corrected value as JSON, written with the schema the dead letter's
    /// registry-framed payload names (a server with `--schema-registry`).
    value: Option<serde_json::Value>,
    /// Headers to set, `name=value`.
    headers: Vec<String>,
}

async fn edit(
    State(state): State<Arc<AdminState>>,
    Path((consumer, id)): Path<(String, String)>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    bytes: axum::body::Bytes,
) -> Reply {
    let Begun { note, dlq, .. } =
        match begin(&state, &headers, Role::Operator, "edit", &consumer, raw) {
            Ok(b) => b,
            Err(reply) => return reply,
        };
    let edit: EditBody = match body(&note, &bytes) {
        Ok(r) => r,
        Err(reply) => return reply,
    };
    let payload = match (edit.payload, edit.payload_base64) {
        (Some(_), Some(_)) => {
            let e = AdminError::InvalidInput {
                field: "payload",
                value: String::new(),
                expected: "either `payload` or `payload_base64`, not both".into(),
            };
            return Reply::failed(note, e);
        }
        (Some(json), None) => Some(bytes::Bytes::from(json.to_string())),
        (None, Some(b64)) => match base64::engine::general_purpose::STANDARD.decode(b64.as_bytes())
        {
            Ok(raw) => Some(bytes::Bytes::from(raw)),
            Err(_) => {
                let e = AdminError::InvalidInput {
                    field: "payload_base64",
                    value: String::new(),
                    expected: "standard base64".into(),
                };
                return Reply::failed(note, e);
            }
        },
        (None, None) => None,
    };
    let request = EditRequest {
        payload,
        value: edit.value,
        headers: edit.headers,
    };
    match dlq.edit(&id, &request).await {
        Ok(outcome) => Reply::ok(note, outcome),
        Err(e) => Reply::failed(note, e),
    }
}

async fn jobs(State(state): State<Arc<AdminState>>, headers: HeaderMap) -> Reply {
    let note = AuditNote {
        action: "jobs",
        ..AuditNote::default()
    };
    match authorize(&state, &headers, Role::Reader, note) {
        Ok(note) => Reply::ok(note, state.jobs.list()),
        Err(reply) => reply,
    }
}

async fn job(
    State(state): State<Arc<AdminState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Reply {
    on_job(&state, &headers, Role::Reader, "job", id, Jobs::get)
}

async fn cancel_job(
    State(state): State<Arc<AdminState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Reply {
    on_job(
        &state,
        &headers,
        Role::Operator,
        "cancel-job",
        id,
        Jobs::cancel,
    )
}

/// `what` on the job `id`, for a caller of at least `role`.
fn on_job(
    state: &AdminState,
    headers: &HeaderMap,
    role: Role,
    action: &'static str,
    id: String,
    what: impl FnOnce(&Jobs, &str) -> Result<crate::jobs::JobView, AdminError>,
) -> Reply {
    let note = AuditNote {
        action,
        job: Some(id.clone()),
        ..AuditNote::default()
    };
    match authorize(state, headers, role, note) {
        Ok(note) => match what(&state.jobs, &id) {
            Ok(view) => Reply::ok(note, view),
            Err(e) => Reply::failed(note, e),
        },
        Err(reply) => reply,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_consumer_spec_gives_its_subscription_and_a_bad_one_names_the_field() {
        let sub = parse_consumer("billing=orders").expect("plain");
        assert_eq!(
            (sub.consumer.as_str(), sub.source.as_str()),
            ("billing", "orders")
        );
        assert!(sub.retry_tiers.is_empty());
        let sub = parse_consumer("billing=orders.v2@1s, 30s,5m").expect("tiers");
        assert_eq!(sub.source, "orders.v2");
        assert_eq!(
            sub.retry_tiers,
            [1, 30, 300].map(Duration::from_secs).to_vec()
        );
        for bad in [
            "billing",
            "=orders",
            "billing=",
            "billing=orders@soon",
            "b=o@",
        ] {
            let e = parse_consumer(bad).expect_err(bad);
            assert!(
                matches!(
                    e,
                    AdminError::InvalidInput {
                        field: "consumer",
                        ..
                    }
                ),
                "{bad}: {e}"
            );
        }
    }
}

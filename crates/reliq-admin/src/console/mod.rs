//! The web console: the same operations as the API, as server-rendered pages under
//! `/console/`, for people.
//!
//! - **Sign-in** with an admin token makes a session: a random id in a cookie
//!   (`HttpOnly`, `SameSite=Strict`, `Path=/console`, `Secure` when the server is told it
//!   sits behind TLS). The session keeps the token's hash, never the token, and checks it
//!   against the tokens file on every request: a removed or expired token ends it.
//! - Every form that changes something carries the session's **CSRF token**; a POST
//!   without it (or with another) is refused with 403.
//! - A **role** decides which buttons a page shows, and the server decides again when the
//!   form is posted: a reader who forges a replay gets 403.
//! - Every request is audited like an API request (the same middleware).

pub mod pages;
mod respond;
mod sso;

use std::sync::Arc;
use std::time::SystemTime;

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use reliq_core::Cursor;

use crate::auth::{Principal, Role, hash_token};
use crate::error::AdminError;
use crate::filter::FilterSpec;
use crate::ops::{Dlq, EditRequest, PurgeRequest, ReplayRequest, Run};
use crate::sessions::{Credential, SESSION_COOKIE};
use crate::state::{AdminState, AuditNote};
use respond::{
    Page, cookie_value, failed, note, page, quiet_note, redirect, refusal, session_cookie,
    set_cookie, with_note,
};

/// The console's routes (merged into the API's router, under its audit middleware).
pub(crate) fn routes() -> Router<Arc<AdminState>> {
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/") }))
        .route("/console/", get(overview))
        .route("/console/assets/console.css", get(stylesheet))
        .route("/console/asyncapi.json", get(asyncapi))
        .route("/console/sign-in", get(sign_in_page).post(sign_in))
        .route("/console/sign-out", post(sign_out))
        .route("/console/oidc/start", get(sso::start))
        .route(crate::oidc::CALLBACK_PATH, get(sso::callback))
        .route("/console/consumers/{consumer}", get(groups))
        .route(
            "/console/consumers/{consumer}/groups/{fingerprint}",
            get(group_triage).post(change_triage),
        )
        .route("/console/consumers/{consumer}/entries", get(entries))
        .route("/console/consumers/{consumer}/entries/{id}", get(detail))
        .route(
            "/console/consumers/{consumer}/entries/{id}/edit",
            post(edit),
        )
        .route("/console/consumers/{consumer}/replay", post(replay))
        .route("/console/consumers/{consumer}/purge", post(purge))
        .route("/console/jobs", get(jobs))
        .route("/console/jobs/{id}", get(job))
        .route("/console/jobs/{id}/cancel", post(cancel_job))
        .route("/console/audit", get(audit))
}

/// Who is signed in, and their CSRF token; or the sign-in page to go to.
struct Visitor {
    who: Principal,
    csrf: String,
}

// The error is the page to answer with (an axum `Response`), returned as it is.
#[allow(clippy::result_large_err)]
fn visitor(state: &AdminState, headers: &HeaderMap, note: &mut AuditNote) -> Result<Visitor, Page> {
    let to_sign_in = |note: &AuditNote| redirect(note.clone(), "/console/sign-in");
    let id = cookie_value(headers, SESSION_COOKIE).ok_or_else(|| to_sign_in(note))?;
    let (credential, csrf) = state.sessions.get(&id).ok_or_else(|| to_sign_in(note))?;
    let who = match credential {
        Credential::Token(hash) => match state.tokens.check_hash(&hash, SystemTime::now()) {
            Ok(who) => who,
            Err(why) => {
                // The token was removed or expired: the session ends with it.
                state.sessions.end(&id);
                note.reason = Some(format!("session ended: {}", why.as_str()));
                return Err(to_sign_in(note));
            }
        },
        Credential::Provider(signed) => {
            if SystemTime::now() >= signed.until {
                // The provider's token expired: so does the session.
                state.sessions.end(&id);
                note.actor = Some(signed.who);
                note.reason = Some("session ended: the identity provider's token expired".into());
                return Err(redirect(note.clone(), "/console/sign-in?ended=expired"));
            }
            signed.who
        }
    };
    note.actor = Some(who.clone());
    Ok(Visitor { who, csrf })
}

/// A POST's form fields, checked: a live session, the CSRF token, a role of at least `role`.
#[allow(clippy::result_large_err)] // the error is the page to answer with
fn posted(
    state: &AdminState,
    headers: &HeaderMap,
    body: &[u8],
    role: Role,
    note: &mut AuditNote,
) -> Result<(Visitor, Vec<(String, String)>), Page> {
    let v = visitor(state, headers, note)?;
    let fields: Vec<(String, String)> = serde_urlencoded::from_bytes(body).unwrap_or_default();
    let csrf = fields
        .iter()
        .find(|(k, _)| k == "csrf")
        .map(|(_, v)| v.as_str());
    let csrf_ok = csrf.is_some_and(|c| {
        bool::from(subtle::ConstantTimeEq::ct_eq(
            c.as_bytes(),
            v.csrf.as_bytes(),
        ))
    });
    if !csrf_ok {
        return Err(refusal(
            note.clone(),
            StatusCode::FORBIDDEN,
            "missing or wrong CSRF token: reload the page and try again".into(),
        ));
    }
    if v.who.role < role {
        let why = format!(
            "role `{}` may not {} (needs `{}`)",
            v.who.role.as_str(),
            note.action,
            role.as_str()
        );
        return Err(refusal(note.clone(), StatusCode::FORBIDDEN, why));
    }
    Ok((v, fields))
}

/// A posted form's field `name`, its line breaks as `\n` (a browser posts a textarea's
/// as CR LF).
fn form_field(fields: &[(String, String)], name: &str) -> Option<String> {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.replace("\r\n", "\n"))
}

/// The DLQ of a consumer the server was started with.
fn known_dlq(state: &AdminState, consumer: &str) -> Result<Dlq, AdminError> {
    let sub = state
        .consumers
        .iter()
        .find(|s| s.consumer == consumer)
        .cloned()
        .ok_or_else(|| AdminError::InvalidInput {
            field: "consumer",
            value: consumer.chars().take(80).collect(),
            expected: "a consumer this server was started with (--consumer name=source)".into(),
        })?;
    state.dlq(sub)
}

async fn stylesheet() -> Response {
    let mut response = (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        pages::STYLESHEET,
    )
        .into_response();
    response
        .extensions_mut()
        .insert(quiet_note("console-asset"));
    response
}

/// The AsyncAPI document of the consumers (`GET /v1/asyncapi.json` for a signed-in
/// visitor), linked from the overview.
async fn asyncapi(State(state): State<Arc<AdminState>>, headers: HeaderMap) -> Page {
    let mut note = note("console-asyncapi", None);
    if let Err(p) = visitor(&state, &headers, &mut note) {
        return p;
    }
    match state.asyncapi().await {
        Ok(doc) => with_note(axum::Json(doc).into_response(), StatusCode::OK, note),
        Err(e) => failed(note, e),
    }
}

async fn sign_in_page(State(state): State<Arc<AdminState>>, RawQuery(query): RawQuery) -> Page {
    let ended = query.as_deref() == Some("ended=expired");
    let notice = ended.then_some("Your sign-in at the identity provider expired: sign in again.");
    page(
        quiet_note("console-sign-in-page"),
        pages::sign_in(notice, state.oidc.is_some()),
    )
}

async fn sign_in(State(state): State<Arc<AdminState>>, body: axum::body::Bytes) -> Page {
    let mut note = note("console-sign-in", None);
    let fields: Vec<(String, String)> = serde_urlencoded::from_bytes(&body).unwrap_or_default();
    let token = fields
        .iter()
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_default();
    let hash = hash_token(&token);
    match state.tokens.check_hash(&hash, SystemTime::now()) {
        Err(why) => {
            note.reason = Some(why.as_str().into());
            let again = pages::sign_in(
                Some("That token is not valid (unknown, removed or expired)."),
                state.oidc.is_some(),
            );
            with_note(again.into_response(), StatusCode::UNAUTHORIZED, note)
        }
        Ok(who) => {
            note.actor = Some(who);
            let id = match state.sessions.start(Credential::Token(hash)) {
                Ok(id) => id,
                Err(e) => return failed(note, e),
            };
            let mut response = redirect(note, "/console/");
            set_cookie(&mut response, &session_cookie(&state, &id));
            response
        }
    }
}

async fn sign_out(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Page {
    let mut note = note("console-sign-out", None);
    if let Err(p) = posted(&state, &headers, &body, Role::Reader, &mut note) {
        return p;
    }
    let mut to = "/console/sign-in".to_owned();
    if let Some(id) = cookie_value(&headers, SESSION_COOKIE) {
        // Signed in at the provider: sign out there too, when it offers that.
        if let (Some((Credential::Provider(signed), _)), Some(oidc)) =
            (state.sessions.get(&id), &state.oidc)
            && let Some(url) = oidc.sign_out_url(&signed).await
        {
            to = url;
        }
        state.sessions.end(&id);
    }
    let mut response = redirect(note, &to);
    set_cookie(
        &mut response,
        &format!("{SESSION_COOKIE}=; HttpOnly; SameSite=Strict; Path=/console; Max-Age=0"),
    );
    response
}

async fn overview(State(state): State<Arc<AdminState>>, headers: HeaderMap) -> Page {
    let mut note = note("console-overview", None);
    let v = match visitor(&state, &headers, &mut note) {
        Ok(v) => v,
        Err(p) => return p,
    };
    let last_hour = FilterSpec {
        since: Some("1h".into()),
        ..FilterSpec::default()
    };
    let everything = FilterSpec::default();
    let mut rows = Vec::new();
    for sub in &state.consumers {
        // Errors as text: the row shows them.
        let (all, recent, backlog) = match state.dlq(sub.clone()) {
            Ok(dlq) => {
                let (all, recent, backlog) = tokio::join!(
                    dlq.stats(&everything),
                    dlq.stats(&last_hour),
                    state.broker.backlog(sub)
                );
                (
                    all.map_err(|e| e.to_string()),
                    recent.map_err(|e| e.to_string()),
                    backlog.map_err(|e| e.to_string()),
                )
            }
            Err(e) => (Err(e.to_string()), Err(e.to_string()), Err(e.to_string())),
        };
        let mut row = pages::OverviewRow {
            consumer: sub.consumer.clone(),
            source: sub.source.clone(),
            count: None,
            oldest_age_seconds: None,
            last_hour: None,
            error: None,
            backlog,
        };
        match (all, recent) {
            (Ok(all), Ok(recent)) => {
                row.count = Some(all.count);
                row.oldest_age_seconds = all.oldest_age_seconds;
                row.last_hour = Some(recent.count);
            }
            (Err(e), _) | (_, Err(e)) => row.error = Some(e),
        }
        rows.push(row);
    }
    page(
        note,
        pages::layout("Overview", &v.who, &v.csrf, pages::overview(&rows)),
    )
}

async fn groups(
    State(state): State<Arc<AdminState>>,
    Path(consumer): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Page {
    let mut note = note("console-groups", Some(&consumer));
    let v = match visitor(&state, &headers, &mut note) {
        Ok(v) => v,
        Err(p) => return p,
    };
    let include_archived = raw.as_deref() == Some("archived=true");
    let stats = match known_dlq(&state, &consumer) {
        Ok(dlq) => {
            let stats = dlq.stats(&FilterSpec::default()).await;
            state.triaged_stats(stats, include_archived).await
        }
        Err(e) => Err(e),
    };
    match stats {
        Ok(stats) => {
            let title = format!("{consumer}: failure groups");
            page(
                note,
                pages::layout(
                    &title,
                    &v.who,
                    &v.csrf,
                    pages::groups(&consumer, &stats, &v.who, &v.csrf, state.triage.is_some()),
                ),
            )
        }
        Err(e) => failed(note, e),
    }
}

/// A failure group's triage: status, assignee, notes; the form for an operator.
async fn group_triage(
    State(state): State<Arc<AdminState>>,
    Path((consumer, fingerprint)): Path<(String, String)>,
    headers: HeaderMap,
) -> Page {
    let mut note = note("console-triage", Some(&consumer));
    let v = match visitor(&state, &headers, &mut note) {
        Ok(v) => v,
        Err(p) => return p,
    };
    let read = async {
        known_dlq(&state, &consumer)?;
        let store = state.triage_store()?;
        store.get(&consumer, &fingerprint).await
    };
    match read.await {
        Ok(t) => {
            let title = format!("{consumer}: group {fingerprint}");
            page(
                note,
                pages::layout(&title, &v.who, &v.csrf, pages::triage(&t, &v.who, &v.csrf)),
            )
        }
        Err(e) => failed(note, e),
    }
}

/// The triage form posted: the status, the assignee (empty: nobody), a note if written.
async fn change_triage(
    State(state): State<Arc<AdminState>>,
    Path((consumer, fingerprint)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Page {
    let mut note = note("triage", Some(&consumer));
    let (v, fields) = match posted(&state, &headers, &body, Role::Operator, &mut note) {
        Ok(ok) => ok,
        Err(p) => return p,
    };
    let field = |name: &str| form_field(&fields, name);
    let changed = async {
        known_dlq(&state, &consumer)?;
        let store = state.triage_store()?;
        let change = crate::triage::TriageChange {
            status: field("status")
                .filter(|s| !s.is_empty())
                .map(|s| s.parse())
                .transpose()?,
            assignee: field("assignee"),
            note: field("note").filter(|n| !n.trim().is_empty()),
        };
        note.detail = Some(change.audit_detail(&fingerprint));
        store
            .change(&consumer, &fingerprint, &v.who.name, &change)
            .await
    };
    match changed.await {
        Ok(_) => redirect(
            note,
            &format!("/console/consumers/{consumer}/groups/{fingerprint}"),
        ),
        Err(e) => failed(note, e),
    }
}

async fn entries(
    State(state): State<Arc<AdminState>>,
    Path(consumer): Path<String>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Page {
    let mut note = note("console-ls", Some(&consumer));
    let v = match visitor(&state, &headers, &mut note) {
        Ok(v) => v,
        Err(p) => return p,
    };
    let pairs: Vec<(String, String)> =
        serde_urlencoded::from_str(raw.as_deref().unwrap_or("")).unwrap_or_default();
    // Empty form fields mean "not this condition".
    let pairs: Vec<(String, String)> = pairs.into_iter().filter(|(_, v)| !v.is_empty()).collect();
    let listed = async {
        let dlq = known_dlq(&state, &consumer)?;
        let spec = FilterSpec::from_pairs(&pairs)?;
        let cursor = pairs
            .iter()
            .find(|(k, _)| k == "cursor")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        dlq.list(&spec, &Cursor::from(cursor), 50).await
    };
    match listed.await {
        Ok(list) => {
            let title = format!("{consumer}: dead letters");
            page(
                note,
                pages::layout(
                    &title,
                    &v.who,
                    &v.csrf,
                    pages::entries(&consumer, &pairs, &list),
                ),
            )
        }
        Err(e) => failed(note, e),
    }
}

async fn detail(
    State(state): State<Arc<AdminState>>,
    Path((consumer, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Page {
    let mut note = note("console-show", Some(&consumer));
    let v = match visitor(&state, &headers, &mut note) {
        Ok(v) => v,
        Err(p) => return p,
    };
    let shown = async { known_dlq(&state, &consumer)?.show(&id).await };
    match shown.await {
        Ok(d) => {
            let title = format!("Dead letter {id}");
            page(
                note,
                pages::layout(
                    &title,
                    &v.who,
                    &v.csrf,
                    pages::detail(&consumer, &d, &v.who, &v.csrf),
                ),
            )
        }
        Err(e) => failed(note, e),
    }
}

/// The filter a console form posted (its hidden fields), and the rest of its fields.
fn form_filter(fields: &[(String, String)]) -> Result<FilterSpec, AdminError> {
    let filter: Vec<(String, String)> = fields
        .iter()
        .filter(|(k, v)| crate::filter::FILTER_FIELDS.contains(&k.as_str()) && !v.is_empty())
        .cloned()
        .collect();
    FilterSpec::from_pairs(&filter)
}

async fn replay(
    State(state): State<Arc<AdminState>>,
    Path(consumer): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Page {
    run(state, consumer, headers, body, Role::Operator, "replay").await
}

async fn purge(
    State(state): State<Arc<AdminState>>,
    Path(consumer): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Page {
    run(state, consumer, headers, body, Role::Admin, "purge").await
}

/// A replay or purge form: a dry run shows the preview page, a run starts a job and goes
/// to its page.
async fn run(
    state: Arc<AdminState>,
    consumer: String,
    headers: HeaderMap,
    body: axum::body::Bytes,
    role: Role,
    action: &'static str,
) -> Page {
    let mut note = note(action, Some(&consumer));
    let (v, fields) = match posted(&state, &headers, &body, role, &mut note) {
        Ok(ok) => ok,
        Err(p) => return p,
    };
    let field = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let parsed = (|| {
        let filter = form_filter(&fields)?;
        let dry_run = field("dry_run") == Some("true");
        let rate = match field("rate").filter(|r| !r.is_empty()) {
            None => None,
            Some(r) => Some(r.parse::<u32>().map_err(|_| AdminError::InvalidInput {
                field: "rate",
                value: r.chars().take(80).collect(),
                expected: "a whole number of messages per second".into(),
            })?),
        };
        let run = if action == "purge" {
            Run::Purge(PurgeRequest { filter, dry_run })
        } else {
            Run::Replay(ReplayRequest {
                filter,
                dry_run,
                rate,
                ..ReplayRequest::default()
            })
        };
        Ok::<_, AdminError>(run)
    })();
    let (run, dlq) = match parsed.and_then(|r| Ok((r, known_dlq(&state, &consumer)?))) {
        Ok(ok) => ok,
        Err(e) => return failed(note, e),
    };
    note.filter = Some(run.filter().clone());
    if run.dry_run() {
        note.action = if action == "purge" {
            "purge-dry-run"
        } else {
            "replay-dry-run"
        };
        return match dlq.run(&run, |_| {}, Default::default()).await {
            Ok(outcome) => {
                note.counts = Some(serde_json::json!({ "matched": outcome.matched }));
                let title = format!("{consumer}: {action} preview");
                page(
                    note,
                    pages::layout(
                        &title,
                        &v.who,
                        &v.csrf,
                        pages::preview(&consumer, &outcome, &fields, &v.csrf),
                    ),
                )
            }
            Err(e) => failed(note, e),
        };
    }
    let filter = run.filter().clone();
    let job = state.jobs.spawn(
        run.operation(),
        &consumer,
        &v.who.name,
        &filter,
        state.audit.clone(),
        |ctx| async move { dlq.run(&run, ctx.progress(), ctx.cancel()).await },
    );
    let job = match job {
        Ok(job) => job,
        Err(e) => return failed(note, e),
    };
    note.job = Some(job.id.clone());
    redirect(note, &format!("/console/jobs/{}", job.id))
}

async fn edit(
    State(state): State<Arc<AdminState>>,
    Path((consumer, id)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Page {
    let mut note = note("edit", Some(&consumer));
    let (_, fields) = match posted(&state, &headers, &body, Role::Operator, &mut note) {
        Ok(ok) => ok,
        Err(p) => return p,
    };
    let field = |name: &str| form_field(&fields, name).unwrap_or_default();
    let payload = field("payload");
    // A registry-framed dead letter's page offers its decoded value: written back with
    // the same schema.
    let value = if field("encoding") == "schema" {
        match serde_json::from_str(&payload) {
            Ok(value) => Some(value),
            Err(e) => {
                let e = AdminError::InvalidInput {
                    field: "payload",
                    value: String::new(),
                    expected: format!("the corrected value as JSON: {e}"),
                };
                return failed(note, e);
            }
        }
    } else {
        None
    };
    let header_lines: Vec<String> = field("headers")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    let request = EditRequest {
        payload: value.is_none().then(|| bytes::Bytes::from(payload)),
        value,
        headers: header_lines,
    };
    let edited = async { known_dlq(&state, &consumer)?.edit(&id, &request).await };
    match edited.await {
        Ok(outcome) => redirect(
            note,
            &format!("/console/consumers/{consumer}?edited={}", outcome.copy),
        ),
        Err(e) => failed(note, e),
    }
}

async fn jobs(State(state): State<Arc<AdminState>>, headers: HeaderMap) -> Page {
    let mut note = note("console-jobs", None);
    match visitor(&state, &headers, &mut note) {
        Ok(v) => page(
            note,
            pages::layout("Jobs", &v.who, &v.csrf, pages::jobs(&state.jobs.list())),
        ),
        Err(p) => p,
    }
}

async fn job(
    State(state): State<Arc<AdminState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Page {
    let mut note = note("console-job", None);
    note.job = Some(id.clone());
    let v = match visitor(&state, &headers, &mut note) {
        Ok(v) => v,
        Err(p) => return p,
    };
    match state.jobs.get(&id) {
        Ok(j) => page(
            note,
            pages::layout(
                &format!("Job {id}"),
                &v.who,
                &v.csrf,
                pages::job(&j, &v.who, &v.csrf),
            ),
        ),
        Err(e) => failed(note, e),
    }
}

async fn cancel_job(
    State(state): State<Arc<AdminState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Page {
    let mut note = note("cancel-job", None);
    note.job = Some(id.clone());
    if let Err(p) = posted(&state, &headers, &body, Role::Operator, &mut note) {
        return p;
    }
    match state.jobs.cancel(&id) {
        Ok(_) => redirect(note, &format!("/console/jobs/{id}")),
        Err(e) => failed(note, e),
    }
}

async fn audit(State(state): State<Arc<AdminState>>, headers: HeaderMap) -> Page {
    let mut note = note("console-audit", None);
    let v = match visitor(&state, &headers, &mut note) {
        Ok(v) => v,
        Err(p) => return p,
    };
    if v.who.role < Role::Admin {
        let why = format!(
            "role `{}` may not read the audit log (needs `admin`)",
            v.who.role.as_str()
        );
        return refusal(note, StatusCode::FORBIDDEN, why);
    }
    let records = state.audit.tail(200);
    page(
        note,
        pages::layout("Audit log", &v.who, &v.csrf, pages::audit(&records)),
    )
}

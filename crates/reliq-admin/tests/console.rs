//! The web console over HTTP on the embedded broker: sign-in and the session cookie, a
//! reader's pages without actions and its forged posts refused, the CSRF token, an
//! operator's dry run, replay (a job) and edit, an admin's purge and audit page, sign-out,
//! and a removed token ending its session. Each test builds its own broker, dead letters,
//! tokens and console through [`fixture`], and ends checking that no token reached the
//! audit log.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use reliq_admin::http::{AdminState, Limits, router};
use reliq_admin::{AuditLog, Role, Tokens, new_token};
use reliq_core::{
    BoxError, Broker, Consumer, ConsumerHandle, Delivery, Destination, Message, Poison,
    seam::headers,
};
use reliq_memory::MemoryBroker;
use tower::ServiceExt;

struct Console {
    app: axum::Router,
}

struct Answer {
    status: StatusCode,
    location: Option<String>,
    cookie: Option<String>,
    headers: header::HeaderMap,
    body: String,
}

impl Console {
    async fn send(
        &self,
        method: &str,
        path: &str,
        cookie: Option<&str>,
        form: Option<&[(&str, &str)]>,
    ) -> anyhow::Result<Answer> {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(c) = cookie {
            request = request.header(header::COOKIE, c);
        }
        let body = match form {
            Some(fields) => {
                request = request.header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
                Body::from(serde_urlencoded::to_string(fields)?)
            }
            None => Body::empty(),
        };
        let response = self.app.clone().oneshot(request.body(body)?).await?;
        let status = response.status();
        let text = |name| {
            response
                .headers()
                .get(name)
                .and_then(|v: &header::HeaderValue| v.to_str().ok())
                .map(str::to_owned)
        };
        let location = text(header::LOCATION);
        let cookie = text(header::SET_COOKIE);
        let headers = response.headers().clone();
        let body = String::from_utf8(response.into_body().collect().await?.to_bytes().to_vec())?;
        Ok(Answer {
            status,
            location,
            cookie,
            headers,
            body,
        })
    }

    /// Sign in with `token`: the session cookie (`name=value`) and the cookie's attributes.
    async fn sign_in(&self, token: &str) -> anyhow::Result<(String, String)> {
        let a = self
            .send("POST", "/console/sign-in", None, Some(&[("token", token)]))
            .await?;
        ensure!(a.status == StatusCode::SEE_OTHER, "sign-in: {}", a.status);
        let set = a.cookie.context("a session cookie")?;
        let pair = set.split(';').next().unwrap_or_default().trim().to_owned();
        Ok((pair, set))
    }

    /// Poll a job's page until the job no longer runs (up to 100 × 50 ms): the last page.
    async fn job_end(&self, job: &str, cookie: &str) -> anyhow::Result<String> {
        let mut state = String::new();
        for _ in 0..100 {
            state = self.send("GET", job, Some(cookie), None).await?.body;
            if !state.contains(r#"data-testid="job-state">running"#) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(state)
    }
}

/// A signed-in session: its cookie, and the group page of consumer `billing` as it saw it
/// with that page's CSRF token.
struct Session {
    cookie: String,
    groups: String,
    csrf: String,
}

/// A console on its own embedded broker: consumer `billing` of `invoices` dead-letters
/// every first-time message as poison ("bad field at byte N") and counts replayed ones;
/// 3 dead letters are parked; a tokens file with a reader (rita), an operator (oscar) and
/// an admin (ada); an audit log file.
struct Fixture {
    console: Console,
    memory: MemoryBroker,
    broker: Arc<dyn Broker>,
    handle: ConsumerHandle,
    replayed: Arc<AtomicUsize>,
    tokens_path: PathBuf,
    audit_path: PathBuf,
    reader: String,
    reader_entry: String,
    operator: String,
    admin: String,
    admin_entry: String,
    _dir: tempfile::TempDir,
}

async fn fixture() -> anyhow::Result<Fixture> {
    let memory = MemoryBroker::new();
    let broker: Arc<dyn Broker> = Arc::new(memory.clone());
    let replayed = Arc::new(AtomicUsize::new(0));
    let seen = replayed.clone();
    let handle = Consumer::builder(broker.clone(), "billing")
        .subscribe("invoices")
        .start(move |d: Delivery| {
            let seen = seen.clone();
            async move {
                if d.headers().get(headers::REPLAY_COUNT).is_some() {
                    seen.fetch_add(1, Ordering::SeqCst);
                    return Ok(());
                }
                Err::<(), BoxError>(
                    Poison::msg(format!("bad field at byte {}", d.payload().len())).into(),
                )
            }
        })
        .await?;
    let dir = tempfile::tempdir()?;
    let tokens_path = dir.path().join("tokens.toml");
    let (reader, reader_entry) = new_token("rita", Role::Reader, None)?;
    let (operator, operator_entry) = new_token("oscar", Role::Operator, None)?;
    let (admin, admin_entry) = new_token("ada", Role::Admin, None)?;
    std::fs::write(
        &tokens_path,
        format!("{reader_entry}\n{operator_entry}\n{admin_entry}"),
    )?;
    let audit_path = dir.path().join("audit.jsonl");
    let state = AdminState::new(
        broker.clone(),
        Tokens::open(&tokens_path)?,
        AuditLog::to_file(&audit_path)?,
    )
    .with_consumers([reliq_admin::http::parse_consumer("billing=invoices")?]);
    let f = Fixture {
        console: Console {
            app: router(Arc::new(state), Limits::default()),
        },
        memory,
        broker,
        handle,
        replayed,
        tokens_path,
        audit_path,
        reader,
        reader_entry,
        operator,
        admin,
        admin_entry,
        _dir: dir,
    };
    f.publish(3).await?;
    f.parked(3).await?;
    Ok(f)
}

impl Fixture {
    /// Publish `n` invoices (`{"invoice":0}`, `{"invoice":1}`, …).
    async fn publish(&self, n: usize) -> anyhow::Result<()> {
        for i in 0..n {
            self.broker
                .publish(
                    &Destination::new("invoices"),
                    Message::new(format!("{{\"invoice\":{i}}}")),
                )
                .await?;
        }
        Ok(())
    }

    /// Wait until the consumer has dead-lettered `n` messages in all.
    async fn parked(&self, n: u64) -> anyhow::Result<()> {
        within_10s(|| self.handle.stats().dead_lettered >= n).await
    }

    /// Wait until the consumer has handled `n` replayed messages in all.
    async fn replayed(&self, n: usize) -> anyhow::Result<()> {
        within_10s(|| self.replayed.load(Ordering::SeqCst) >= n).await
    }

    fn dead_letters(&self) -> usize {
        self.memory
            .dead_letter_depth(&reliq_core::Subscription::new("billing", "invoices"))
    }

    async fn get(&self, path: &str, cookie: &str) -> anyhow::Result<Answer> {
        self.console.send("GET", path, Some(cookie), None).await
    }

    async fn post(
        &self,
        path: &str,
        cookie: &str,
        form: &[(&str, &str)],
    ) -> anyhow::Result<Answer> {
        self.console
            .send("POST", path, Some(cookie), Some(form))
            .await
    }

    /// Sign in with `token` and open the group page.
    async fn session(&self, token: &str) -> anyhow::Result<Session> {
        let (cookie, _) = self.console.sign_in(token).await?;
        let groups = self.get("/console/consumers/billing", &cookie).await?.body;
        let csrf = csrf_of(&groups)?;
        Ok(Session {
            cookie,
            groups,
            csrf,
        })
    }

    /// As `s` (an operator), replay the group of `fingerprint` at 50/s: a job, which
    /// succeeds, and the consumer then handles the group's 3.
    async fn replay_the_group(&self, s: &Session, fingerprint: &str) -> anyhow::Result<()> {
        let form = [
            ("csrf", &*s.csrf),
            ("fingerprint", fingerprint),
            ("rate", "50"),
        ];
        let started = self
            .post("/console/consumers/billing/replay", &s.cookie, &form)
            .await?;
        let job = started.location.clone().context("the job's page")?;
        ensure!(
            started.status == StatusCode::SEE_OTHER && job.starts_with("/console/jobs/"),
            "{:?}",
            started.location
        );
        let state = self.console.job_end(&job, &s.cookie).await?;
        ensure!(
            state.contains(r#"data-testid="job-state">succeeded"#),
            "{state}"
        );
        self.replayed(3).await
    }

    /// The audit log holds none of the tokens; stop the consumer.
    async fn finish(self) -> anyhow::Result<()> {
        let audit = std::fs::read_to_string(&self.audit_path)?;
        for token in [&self.reader, &self.operator, &self.admin] {
            ensure!(
                !audit.contains(token.as_str()),
                "a token is in the audit log"
            );
        }
        self.handle.shutdown().await;
        Ok(())
    }
}

/// Wait up to 10 s for `done`, polling every 20 ms.
async fn within_10s(done: impl Fn() -> bool) -> anyhow::Result<()> {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await
        }
    })
    .await?;
    Ok(())
}

/// The CSRF token a page's forms carry.
fn csrf_of(page: &str) -> anyhow::Result<String> {
    let at = page
        .find(r#"name="csrf" value=""#)
        .context("a CSRF field")?;
    let rest = &page[at + r#"name="csrf" value=""#.len()..];
    Ok(rest[..rest.find('"').context("end of the CSRF value")?].to_owned())
}

/// The first failure group's fingerprint on a group page (its entries link).
fn fingerprint_of(page: &str) -> anyhow::Result<String> {
    let at = page
        .find("entries?fingerprint=")
        .context("a fingerprint link")?
        + "entries?fingerprint=".len();
    Ok(page
        .get(at..at + 16)
        .context("a 16-character fingerprint")?
        .to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_out_pages_send_you_to_sign_in_and_a_wrong_token_is_refused() -> anyhow::Result<()> {
    let f = fixture().await?;
    let a = f.console.send("GET", "/console/", None, None).await?;
    ensure!(a.status == StatusCode::SEE_OTHER && a.location.as_deref() == Some("/console/sign-in"));
    let a = f
        .console
        .send(
            "POST",
            "/console/sign-in",
            None,
            Some(&[("token", "rlq_wrong")]),
        )
        .await?;
    ensure!(
        a.status == StatusCode::UNAUTHORIZED && a.cookie.is_none(),
        "{}",
        a.status
    );
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_in_sets_a_strict_http_only_session_cookie_without_the_token() -> anyhow::Result<()> {
    let f = fixture().await?;
    let (_, attributes) = f.console.sign_in(&f.reader).await?;
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
        ensure!(
            attributes.contains(attribute),
            "cookie without {attribute}: {attributes}"
        );
    }
    ensure!(
        !attributes.contains(&f.reader),
        "the token is in the cookie"
    );
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_sees_the_pages_without_actions_and_its_forged_post_is_refused()
-> anyhow::Result<()> {
    let f = fixture().await?;
    let rita = f.session(&f.reader).await?;
    let a = f.get("/console/", &rita.cookie).await?;
    ensure!(
        a.status == StatusCode::OK
            && a.body.contains("billing")
            && a.body.contains(r#"<td class="num dead">3</td>"#)
            && a.body.contains(r#"<td class="num waiting">0</td>"#),
        "{}",
        a.body
    );
    ensure!(
        rita.groups.contains("bad field at byte &lt;n&gt;")
            && rita.groups.contains(r#"<td class="num">3</td>"#),
        "{}",
        rita.groups
    );
    ensure!(
        !rita.groups.contains("/console/consumers/billing/replay"),
        "a reader sees a replay button"
    );
    let forged = f
        .post(
            "/console/consumers/billing/replay",
            &rita.cookie,
            &[("csrf", &rita.csrf), ("dry_run", "true")],
        )
        .await?;
    ensure!(
        forged.status == StatusCode::FORBIDDEN && forged.body.contains("reader"),
        "{}",
        forged.status
    );
    // The overview links the consumers' AsyncAPI document, which a reader may fetch.
    ensure!(
        a.body.contains(r#"href="/console/asyncapi.json""#),
        "{}",
        a.body
    );
    let asyncapi = f.get("/console/asyncapi.json", &rita.cookie).await?;
    let doc: serde_json::Value = serde_json::from_str(&asyncapi.body)?;
    ensure!(
        asyncapi.status == StatusCode::OK && doc["channels"]["invoices_billing_dlq"].is_object(),
        "{}",
        asyncapi.body
    );
    let signed_out = f
        .console
        .send("GET", "/console/asyncapi.json", None, None)
        .await?;
    ensure!(
        signed_out.status == StatusCode::SEE_OTHER,
        "{}",
        signed_out.status
    );
    let audit_page = f.get("/console/audit", &rita.cookie).await?;
    ensure!(audit_page.status == StatusCode::FORBIDDEN);
    let audit = std::fs::read_to_string(&f.audit_path)?;
    ensure!(
        audit
            .lines()
            .any(|l| l.contains("\"status\":403") && l.contains("rita")),
        "the forged post is not audited"
    );
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_post_without_its_own_sessions_csrf_token_is_refused() -> anyhow::Result<()> {
    let f = fixture().await?;
    let rita = f.session(&f.reader).await?;
    let oscar = f.session(&f.operator).await?;
    ensure!(
        oscar.groups.contains("/console/consumers/billing/replay"),
        "an operator sees no replay button"
    );
    ensure!(
        !oscar.groups.contains("/console/consumers/billing/purge"),
        "an operator sees a purge button"
    );
    ensure!(oscar.csrf != rita.csrf, "two sessions share a CSRF token");
    let fingerprint = fingerprint_of(&oscar.groups)?;
    let replay = "/console/consumers/billing/replay";
    let no_csrf = f
        .post(
            replay,
            &oscar.cookie,
            &[("fingerprint", &fingerprint), ("dry_run", "true")],
        )
        .await?;
    ensure!(
        no_csrf.status == StatusCode::FORBIDDEN && no_csrf.body.contains("CSRF"),
        "{}",
        no_csrf.status
    );
    let wrong_csrf = f
        .post(
            replay,
            &oscar.cookie,
            &[("csrf", &rita.csrf), ("fingerprint", &fingerprint)],
        )
        .await?;
    ensure!(
        wrong_csrf.status == StatusCode::FORBIDDEN,
        "another session's CSRF token was taken"
    );
    ensure!(f.dead_letters() == 3, "a refused post moved something");
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_dry_run_changes_nothing() -> anyhow::Result<()> {
    let f = fixture().await?;
    let oscar = f.session(&f.operator).await?;
    let fingerprint = fingerprint_of(&oscar.groups)?;
    let preview = f
        .post(
            "/console/consumers/billing/replay",
            &oscar.cookie,
            &[
                ("csrf", &oscar.csrf),
                ("fingerprint", &fingerprint),
                ("dry_run", "true"),
            ],
        )
        .await?;
    ensure!(
        preview.status == StatusCode::OK
            && preview
                .body
                .contains("<strong>3</strong> dead letters would be replayed"),
        "{}",
        preview.body
    );
    ensure!(f.dead_letters() == 3, "a dry run moved something");
    ensure!(f.replayed.load(Ordering::SeqCst) == 0);
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_replay_runs_as_a_job_and_the_consumer_handles_the_group() -> anyhow::Result<()>
{
    let f = fixture().await?;
    let oscar = f.session(&f.operator).await?;
    let fingerprint = fingerprint_of(&oscar.groups)?;
    f.replay_the_group(&oscar, &fingerprint).await?;
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_opens_a_message_and_edits_and_replays_it() -> anyhow::Result<()> {
    let f = fixture().await?;
    let oscar = f.session(&f.operator).await?;
    // The group replayed first, so the one new dead letter is the only entry.
    f.replay_the_group(&oscar, &fingerprint_of(&oscar.groups)?)
        .await?;
    f.publish(1).await?;
    f.parked(4).await?;
    let list = f
        .get("/console/consumers/billing/entries", &oscar.cookie)
        .await?;
    let at = list
        .body
        .find("/console/consumers/billing/entries/")
        .context("an entry link")?;
    let link = &list.body[at..];
    let link = link[..link.find('"').context("end of the link")?].to_owned();
    let detail = f.get(&link, &oscar.cookie).await?;
    ensure!(
        detail.body.contains("poison") && detail.body.contains("&quot;invoice&quot;: 0"),
        "{}",
        detail.body
    );
    let edited = f
        .post(
            &format!("{link}/edit"),
            &oscar.cookie,
            &[
                ("csrf", &oscar.csrf),
                ("payload", "{\"invoice\":0,\"fixed\":true}"),
                ("headers", "x-fixed=1"),
            ],
        )
        .await?;
    ensure!(
        edited.status == StatusCode::SEE_OTHER,
        "edit: {} {}",
        edited.status,
        edited.body
    );
    f.replayed(4).await?;
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_purges_a_group_and_reads_the_audit_page() -> anyhow::Result<()> {
    let f = fixture().await?;
    // The operator's sign-in, for the audit page to show.
    f.console.sign_in(&f.operator).await?;
    let ada = f.session(&f.admin).await?;
    ensure!(
        ada.groups.contains("/console/consumers/billing/purge"),
        "an admin sees no purge button"
    );
    let fingerprint = fingerprint_of(&ada.groups)?;
    let purge = f
        .post(
            "/console/consumers/billing/purge",
            &ada.cookie,
            &[("csrf", &ada.csrf), ("fingerprint", &fingerprint)],
        )
        .await?;
    let job = purge.location.context("the purge job")?;
    let state = f.console.job_end(&job, &ada.cookie).await?;
    ensure!(
        state.contains(r#"data-testid="job-state">succeeded"#),
        "{state}"
    );
    ensure!(f.dead_letters() == 0, "the purge left entries");
    let audit_page = f.get("/console/audit", &ada.cookie).await?;
    ensure!(
        audit_page.status == StatusCode::OK
            && audit_page.body.contains("console-sign-in")
            && audit_page.body.contains("oscar"),
        "{}",
        audit_page.body
    );
    f.finish().await
}

/// The browser-hardening headers an answer must carry, whatever answered.
fn hardened(what: &str, a: &Answer) -> anyhow::Result<()> {
    let get = |name: header::HeaderName| {
        a.headers
            .get(&name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let csp = get(header::CONTENT_SECURITY_POLICY);
    for directive in [
        "default-src 'none'",
        "style-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ] {
        ensure!(
            csp.contains(directive),
            "{what}: CSP `{csp}` lacks `{directive}`"
        );
    }
    ensure!(
        !csp.contains("script-src"),
        "{what}: the CSP allows scripts: `{csp}`"
    );
    ensure!(
        get(header::X_FRAME_OPTIONS) == "DENY",
        "{what}: X-Frame-Options"
    );
    ensure!(
        get(header::X_CONTENT_TYPE_OPTIONS) == "nosniff",
        "{what}: X-Content-Type-Options"
    );
    ensure!(
        get(header::REFERRER_POLICY) == "no-referrer",
        "{what}: Referrer-Policy"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_carries_the_browser_hardening_headers() -> anyhow::Result<()> {
    let f = fixture().await?;
    let signed_out = f.console.send("GET", "/console/", None, None).await?;
    hardened("a signed-out page", &signed_out)?;
    let sign_in = f
        .console
        .send("GET", "/console/sign-in", None, None)
        .await?;
    hardened("the sign-in page", &sign_in)?;
    let refused = f
        .console
        .send(
            "POST",
            "/console/sign-in",
            None,
            Some(&[("token", "wrong")]),
        )
        .await?;
    hardened("a refused sign-in", &refused)?;
    let ada = f.session(&f.admin).await?;
    for path in [
        "/console/",
        "/console/consumers/billing?source=invoices",
        "/console/audit",
        "/console/assets/console.css",
        "/console/no-such-page",
        "/v1/openapi.json",
    ] {
        let page = f.get(path, &ada.cookie).await?;
        hardened(path, &page)?;
    }
    let message = f
        .get(
            "/console/consumers/billing/entries?source=invoices",
            &ada.cookie,
        )
        .await?;
    let at = message
        .body
        .find("/console/consumers/billing/entries/")
        .context("a link to a message")?;
    let link: String = message.body[at..]
        .chars()
        .take_while(|c| *c != '"')
        .collect();
    let detail = f.get(&link.replace("&amp;", "&"), &ada.cookie).await?;
    ensure!(detail.status == StatusCode::OK, "{link}: {}", detail.status);
    hardened("a message page", &detail)?;
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_out_ends_the_session() -> anyhow::Result<()> {
    let f = fixture().await?;
    let ada = f.session(&f.admin).await?;
    let out = f
        .post("/console/sign-out", &ada.cookie, &[("csrf", &ada.csrf)])
        .await?;
    ensure!(
        out.status == StatusCode::SEE_OTHER && out.cookie.is_some_and(|c| c.contains("Max-Age=0"))
    );
    let after = f.get("/console/", &ada.cookie).await?;
    ensure!(
        after.status == StatusCode::SEE_OTHER,
        "signed out, still in: {}",
        after.status
    );
    f.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_taken_out_of_the_file_ends_its_sessions() -> anyhow::Result<()> {
    let f = fixture().await?;
    let (oscar, _) = f.console.sign_in(&f.operator).await?;
    let before = f.get("/console/", &oscar).await?;
    ensure!(
        before.status == StatusCode::OK,
        "signed in: {}",
        before.status
    );
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(
        &f.tokens_path,
        format!("{}\n{}", f.reader_entry, f.admin_entry),
    )?;
    let revoked = f.get("/console/", &oscar).await?;
    ensure!(
        revoked.status == StatusCode::SEE_OTHER,
        "a removed token's session goes on: {}",
        revoked.status
    );
    f.finish().await
}

/// A request to the API from `peer` with `token` as its bearer: the status, and the
/// `Retry-After` header when there is one.
async fn api_from(
    f: &Fixture,
    peer: &str,
    token: &str,
) -> anyhow::Result<(StatusCode, Option<u64>)> {
    let mut request = Request::builder()
        .uri("/v1/consumers/billing/dlq/stats?source=invoices")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())?;
    let peer: std::net::SocketAddr = peer.parse()?;
    request
        .extensions_mut()
        .insert(axum::extract::ConnectInfo(peer));
    let response = f.console.app.clone().oneshot(request).await?;
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    Ok((response.status(), retry_after))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guessing_tokens_is_throttled_per_address_and_the_audit_log_stays_bounded()
-> anyhow::Result<()> {
    let f = fixture().await?;
    let guesser = "192.0.2.7:40000";
    let mut statuses = Vec::new();
    for i in 0..200 {
        statuses.push(api_from(&f, guesser, &format!("wrong-{i}")).await?);
    }
    // The default budget: 10 failures, the 11th exhausts it (answered 401 too), then 429
    // with a wait of at most its refill (6 s).
    let unauthorized = statuses
        .iter()
        .filter(|(s, _)| *s == StatusCode::UNAUTHORIZED)
        .count();
    ensure!(unauthorized == 11, "{unauthorized} answered 401, not 11");
    ensure!(
        statuses[11..]
            .iter()
            .all(|(s, wait)| *s == StatusCode::TOO_MANY_REQUESTS
                && wait.is_some_and(|w| (1..=6).contains(&w))),
        "after the budget: {:?}",
        &statuses[11..14]
    );
    // While blocked, the address's credentials are not even checked: the right token
    // from it is refused too; from another address it is served.
    let (blocked, _) = api_from(&f, guesser, &f.reader).await?;
    ensure!(blocked == StatusCode::TOO_MANY_REQUESTS, "{blocked}");
    let (served, _) = api_from(&f, "198.51.100.1:40000", &f.reader).await?;
    ensure!(served == StatusCode::OK, "another address: {served}");
    // The audit log: the 11 failures one by one, the 190 throttled answers not at all.
    let audit = std::fs::read_to_string(&f.audit_path)?;
    let from_guesser = audit.lines().filter(|l| l.contains("192.0.2.7")).count();
    ensure!(
        from_guesser == 11,
        "{from_guesser} audit records from the guesser"
    );
    // After the wait the address is served again, and one record sums up the block.
    tokio::time::sleep(Duration::from_millis(6_200)).await;
    let (again, _) = api_from(&f, guesser, &f.reader).await?;
    ensure!(again == StatusCode::OK, "after the wait: {again}");
    let audit = std::fs::read_to_string(&f.audit_path)?;
    let summary: Vec<&str> = audit
        .lines()
        .filter(|l| l.contains("192.0.2.7") && l.contains("throttled"))
        .collect();
    ensure!(
        summary.len() == 1 && summary[0].contains("190 more request(s) refused"),
        "{summary:?}"
    );
    f.finish().await
}

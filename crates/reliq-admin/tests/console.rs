//! The web console over HTTP on the embedded broker: sign-in and the session cookie, a
//! reader's pages without actions and its forged posts refused, the CSRF token, an
//! operator's dry run, replay (a job) and edit, an admin's purge and audit page, sign-out,
//! and a removed token ending its session.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use reliq_admin::http::{AdminState, Limits, router};
use reliq_admin::{AuditLog, Role, Tokens, new_token};
use reliq_core::{BoxError, Broker, Consumer, Delivery, Destination, Message, Poison, headers};
use reliq_memory::MemoryBroker;
use tower::ServiceExt;

struct Console {
    app: axum::Router,
}

struct Answer {
    status: StatusCode,
    location: Option<String>,
    cookie: Option<String>,
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
        let body = String::from_utf8(response.into_body().collect().await?.to_bytes().to_vec())?;
        Ok(Answer {
            status,
            location,
            cookie,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_signs_in_checks_roles_and_csrf_and_runs_the_operations() -> anyhow::Result<()> {
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
    let publish = async |n: usize| -> anyhow::Result<()> {
        for i in 0..n {
            broker
                .publish(
                    &Destination::new("invoices"),
                    Message::new(format!("{{\"invoice\":{i}}}")),
                )
                .await?;
        }
        Ok(())
    };
    publish(3).await?;
    let parked = |n: u64| handle.stats().dead_lettered >= n;
    within_10s(|| parked(3)).await?;

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
    let console = Console {
        app: router(Arc::new(state), Limits::default()),
    };

    // Signed out: every page sends you to sign in; a wrong token is refused.
    let a = console.send("GET", "/console/", None, None).await?;
    ensure!(a.status == StatusCode::SEE_OTHER && a.location.as_deref() == Some("/console/sign-in"));
    let a = console
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

    // A reader: the overview and the groups, no action; a forged post refused.
    let (rita, attributes) = console.sign_in(&reader).await?;
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
        ensure!(
            attributes.contains(attribute),
            "cookie without {attribute}: {attributes}"
        );
    }
    ensure!(!attributes.contains(&reader), "the token is in the cookie");
    let a = console.send("GET", "/console/", Some(&rita), None).await?;
    ensure!(
        a.status == StatusCode::OK
            && a.body.contains("billing")
            && a.body.contains(r#"<td class="num dead">3</td>"#)
            && a.body.contains(r#"<td class="num waiting">0</td>"#),
        "{}",
        a.body
    );
    let groups = console
        .send("GET", "/console/consumers/billing", Some(&rita), None)
        .await?;
    ensure!(
        groups.body.contains("bad field at byte &lt;n&gt;")
            && groups.body.contains(r#"<td class="num">3</td>"#),
        "{}",
        groups.body
    );
    ensure!(
        !groups.body.contains("/console/consumers/billing/replay"),
        "a reader sees a replay button"
    );
    let rita_csrf = csrf_of(&groups.body)?;
    let forged = console
        .send(
            "POST",
            "/console/consumers/billing/replay",
            Some(&rita),
            Some(&[("csrf", &rita_csrf), ("dry_run", "true")]),
        )
        .await?;
    ensure!(
        forged.status == StatusCode::FORBIDDEN && forged.body.contains("reader"),
        "{}",
        forged.status
    );
    let audit_page = console
        .send("GET", "/console/audit", Some(&rita), None)
        .await?;
    ensure!(audit_page.status == StatusCode::FORBIDDEN);

    // An operator: no CSRF token, refused; a dry run changes nothing; the replay runs as
    // a job and the consumer handles exactly the group's 3.
    let (oscar, _) = console.sign_in(&operator).await?;
    let groups = console
        .send("GET", "/console/consumers/billing", Some(&oscar), None)
        .await?;
    ensure!(
        groups.body.contains("/console/consumers/billing/replay"),
        "an operator sees no replay button"
    );
    ensure!(
        !groups.body.contains("/console/consumers/billing/purge"),
        "an operator sees a purge button"
    );
    let csrf = csrf_of(&groups.body)?;
    ensure!(csrf != rita_csrf, "two sessions share a CSRF token");
    let fingerprint = {
        let at = groups
            .body
            .find("fingerprint=")
            .context("a fingerprint link")?
            + "fingerprint=".len();
        groups.body[at..at + 16].to_owned()
    };
    let no_csrf = console
        .send(
            "POST",
            "/console/consumers/billing/replay",
            Some(&oscar),
            Some(&[("fingerprint", &fingerprint), ("dry_run", "true")]),
        )
        .await?;
    ensure!(
        no_csrf.status == StatusCode::FORBIDDEN && no_csrf.body.contains("CSRF"),
        "{}",
        no_csrf.status
    );
    let wrong_csrf = console
        .send(
            "POST",
            "/console/consumers/billing/replay",
            Some(&oscar),
            Some(&[("csrf", &rita_csrf), ("fingerprint", &fingerprint)]),
        )
        .await?;
    ensure!(
        wrong_csrf.status == StatusCode::FORBIDDEN,
        "another session's CSRF token was taken"
    );
    let preview = console
        .send(
            "POST",
            "/console/consumers/billing/replay",
            Some(&oscar),
            Some(&[
                ("csrf", &csrf),
                ("fingerprint", &fingerprint),
                ("dry_run", "true"),
            ]),
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
    ensure!(
        memory.dead_letter_depth(&reliq_core::Subscription::new("billing", "invoices")) == 3,
        "a dry run moved something"
    );
    ensure!(replayed.load(Ordering::SeqCst) == 0);
    let started = console
        .send(
            "POST",
            "/console/consumers/billing/replay",
            Some(&oscar),
            Some(&[
                ("csrf", &csrf),
                ("fingerprint", &fingerprint),
                ("rate", "50"),
            ]),
        )
        .await?;
    let job = started.location.clone().context("the job's page")?;
    ensure!(
        started.status == StatusCode::SEE_OTHER && job.starts_with("/console/jobs/"),
        "{:?}",
        started.location
    );
    let mut state = String::new();
    for _ in 0..100 {
        let page = console.send("GET", &job, Some(&oscar), None).await?;
        state = page.body;
        if !state.contains(r#"data-testid="job-state">running"#) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(
        state.contains(r#"data-testid="job-state">succeeded"#),
        "{state}"
    );
    within_10s(|| replayed.load(Ordering::SeqCst) >= 3).await?;

    // A message's page, and edit-and-replay.
    publish(1).await?;
    within_10s(|| parked(4)).await?;
    let list = console
        .send(
            "GET",
            "/console/consumers/billing/entries",
            Some(&oscar),
            None,
        )
        .await?;
    let at = list
        .body
        .find("/console/consumers/billing/entries/")
        .context("an entry link")?;
    let link = &list.body[at..];
    let link = link[..link.find('"').context("end of the link")?].to_owned();
    let detail = console.send("GET", &link, Some(&oscar), None).await?;
    ensure!(
        detail.body.contains("poison") && detail.body.contains("&quot;invoice&quot;: 0"),
        "{}",
        detail.body
    );
    let edited = console
        .send(
            "POST",
            &format!("{link}/edit"),
            Some(&oscar),
            Some(&[
                ("csrf", &csrf),
                ("payload", "{\"invoice\":0,\"fixed\":true}"),
                ("headers", "x-fixed=1"),
            ]),
        )
        .await?;
    ensure!(
        edited.status == StatusCode::SEE_OTHER,
        "edit: {} {}",
        edited.status,
        edited.body
    );
    within_10s(|| replayed.load(Ordering::SeqCst) >= 4).await?;

    // An admin purges a group and reads the audit log.
    publish(2).await?;
    within_10s(|| parked(6)).await?;
    let (ada, _) = console.sign_in(&admin).await?;
    let groups = console
        .send("GET", "/console/consumers/billing", Some(&ada), None)
        .await?;
    ensure!(
        groups.body.contains("/console/consumers/billing/purge"),
        "an admin sees no purge button"
    );
    let admin_csrf = csrf_of(&groups.body)?;
    let purge = console
        .send(
            "POST",
            "/console/consumers/billing/purge",
            Some(&ada),
            Some(&[("csrf", &admin_csrf), ("fingerprint", &fingerprint)]),
        )
        .await?;
    let job = purge.location.context("the purge job")?;
    for _ in 0..100 {
        if console
            .send("GET", &job, Some(&ada), None)
            .await?
            .body
            .contains(r#"data-testid="job-state">succeeded"#)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(
        memory.dead_letter_depth(&reliq_core::Subscription::new("billing", "invoices")) == 0,
        "the purge left entries"
    );
    let audit_page = console
        .send("GET", "/console/audit", Some(&ada), None)
        .await?;
    ensure!(
        audit_page.status == StatusCode::OK
            && audit_page.body.contains("console-sign-in")
            && audit_page.body.contains("oscar"),
        "{}",
        audit_page.body
    );

    // Sign-out ends the session; a token taken out of the file ends its sessions.
    let out = console
        .send(
            "POST",
            "/console/sign-out",
            Some(&ada),
            Some(&[("csrf", &admin_csrf)]),
        )
        .await?;
    ensure!(
        out.status == StatusCode::SEE_OTHER && out.cookie.is_some_and(|c| c.contains("Max-Age=0"))
    );
    let after = console.send("GET", "/console/", Some(&ada), None).await?;
    ensure!(
        after.status == StatusCode::SEE_OTHER,
        "signed out, still in: {}",
        after.status
    );
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&tokens_path, format!("{reader_entry}\n{admin_entry}"))?;
    let revoked = console.send("GET", "/console/", Some(&oscar), None).await?;
    ensure!(
        revoked.status == StatusCode::SEE_OTHER,
        "a removed token's session goes on: {}",
        revoked.status
    );

    let audit = std::fs::read_to_string(&audit_path)?;
    for token in [&reader, &operator, &admin] {
        ensure!(
            !audit.contains(token.as_str()),
            "a token is in the audit log"
        );
    }
    ensure!(
        audit
            .lines()
            .any(|l| l.contains("\"status\":403") && l.contains("rita")),
        "the forged post is not audited"
    );
    handle.shutdown().await;
    Ok(())
}

//! `reliq admin serve` on NATS, over HTTP: every refusal with its status (no token, a
//! wrong one, an expired one, a removed one, a reader replaying, an operator purging), the
//! operations a role may do, jobs polled to their end, the body limit, the OpenAPI
//! document — and the audit log holding every request, with no token anywhere in the
//! server's output or its log. Each test starts its own consumer (unique names) with its
//! own dead letters, tokens and server through [`fixture`], and ends with [`Fixture::finish`],
//! which checks the audit log and the server's output.

mod support;

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use reliq_core::{Broker, ConsumerHandle, MessageId};
use serde_json::{Value, json};
use support::{Effects, Server, Token, consumer, park, token, unique, url, wait_for};

async fn call(
    http: &reqwest::Client,
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> anyhow::Result<(u16, Value)> {
    let mut request = match method {
        "GET" => http.get(url),
        "POST" => http.post(url),
        "PUT" => http.put(url),
        other => bail!("method {other}"),
    };
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    if let Some(b) = body {
        request = request
            .header("content-type", "application/json")
            .body(b.to_string());
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    Ok((
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

/// Poll a job until it is no longer running: how many requests that took, and the job.
async fn job_end(http: &reqwest::Client, url: &str, token: &str) -> anyhow::Result<(usize, Value)> {
    for polls in 1..=100 {
        let (status, job) = call(http, "GET", url, Some(token), None).await?;
        ensure!(status == 200, "GET {url}: {status}: {job}");
        if job["state"] != "running" {
            return Ok((polls, job));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the job at {url} still runs after 10 s")
}

/// The server, stopped when dropped (a test that fails early leaves no process behind).
struct Running(Option<Server>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(server) = self.0.take() {
            let _ = server.stop();
        }
    }
}

/// A consumer of its own on NATS with dead letters parked, five tokens (a reader, an
/// operator, an admin, an operator's expiring after 1 s, an admin's to be removed) in a
/// tokens file, and `reliq admin serve` for that consumer with an audit log; the requests
/// made through it counted.
struct Fixture {
    name: String,
    source: String,
    handle: ConsumerHandle,
    effects: Effects,
    ids: Vec<MessageId>,
    reader: Token,
    operator: Token,
    admin: Token,
    expired: Token,
    removed: Token,
    tokens: PathBuf,
    audit: PathBuf,
    _dir: tempfile::TempDir,
    server: Running,
    base: String,
    http: reqwest::Client,
    dlq: String,
    q: String,
    stats: String,
    replay: String,
    purge: String,
    requests: Cell<usize>,
}

/// The fixture, with `parked` dead letters.
async fn fixture(parked: usize) -> anyhow::Result<Fixture> {
    let url = url("nats");
    let (name, source) = (unique("api"), unique("api-src"));
    let broker: Arc<dyn Broker> = reliq::connect(&url).await?;
    let (handle, effects) = consumer(broker.clone(), &name, &source).await?;
    let ids = park(&broker, &handle, &source, parked, Duration::from_secs(60)).await?;
    let reader = token("rita-reader", "reader", None)?;
    let operator = token("oscar-operator", "operator", None)?;
    let admin = token("ada-admin", "admin", None)?;
    let expired = token("eve-expired", "operator", Some("1s"))?;
    let removed = token("rob-removed", "admin", None)?;
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    let audit = dir.path().join("audit.jsonl");
    let all = [&reader, &operator, &admin, &expired, &removed]
        .map(|t| t.entry.as_str())
        .join("\n");
    std::fs::write(&tokens, &all)?;
    let server = Server::start(&url, &format!("{name}={source}"), &tokens, &audit)?;
    let base = server.base.clone();
    // reqwest is built without a TLS provider of its own (plain HTTP here).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dlq = format!("{base}/v1/consumers/{name}/dlq");
    let q = format!("source={source}");
    Ok(Fixture {
        stats: format!("{dlq}/stats?{q}"),
        replay: format!("{dlq}/replay?{q}"),
        purge: format!("{dlq}/purge?{q}"),
        name,
        source,
        handle,
        effects,
        ids,
        reader,
        operator,
        admin,
        expired,
        removed,
        tokens,
        audit,
        _dir: dir,
        server: Running(Some(server)),
        base,
        http: reqwest::Client::new(),
        dlq,
        q,
        requests: Cell::new(0),
    })
}

impl Fixture {
    /// One request, counted, which must answer `status`: its body.
    async fn expect(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
        status: u16,
    ) -> anyhow::Result<Value> {
        self.requests.set(self.requests.get() + 1);
        let (got, value) = call(&self.http, method, path, token, body).await?;
        ensure!(
            got == status,
            "{method} {path}: {got}, expected {status}: {value}"
        );
        Ok(value)
    }

    /// [`job_end`] as the reader, its polls counted.
    async fn job_end(&self, url: &str) -> anyhow::Result<Value> {
        let (polls, finished) = job_end(&self.http, url, &self.reader.secret).await?;
        self.requests.set(self.requests.get() + polls);
        Ok(finished)
    }

    /// The operator replays the first dead letter at 100/s: a job, run to success by
    /// oscar-operator, and the replayed copy handled. The job's URL.
    async fn replay_the_first(&self) -> anyhow::Result<String> {
        let one = self.ids[0].as_str();
        let body = json!({"filter": {"id": [one]}, "rate": 100});
        let job = self
            .expect(
                "POST",
                &self.replay,
                Some(&self.operator.secret),
                Some(body),
                202,
            )
            .await?;
        let job_url = format!(
            "{}/v1/jobs/{}",
            self.base,
            job["id"].as_str().context("job id")?
        );
        let finished = self.job_end(&job_url).await?;
        ensure!(
            finished["state"] == "succeeded" && finished["outcome"]["done"] == 1,
            "{finished}"
        );
        ensure!(finished["actor"] == "oscar-operator", "{finished}");
        wait_for("the replayed copy handled", Duration::from_secs(30), || {
            self.effects.snapshot().contains_key(&self.ids[0])
        })
        .await?;
        Ok(job_url)
    }

    /// The operator edits and replays the second dead letter.
    async fn edit_the_second(&self) -> anyhow::Result<()> {
        let edit = format!(
            "{}/entries/{}/edit?{}",
            self.dlq,
            self.ids[1].as_str(),
            self.q
        );
        let body = json!({"payload": {"order": 1, "fixed": true}});
        let edited = self
            .expect("POST", &edit, Some(&self.operator.secret), Some(body), 200)
            .await?;
        ensure!(edited["original"] == self.ids[1].as_str(), "{edited}");
        Ok(())
    }

    /// The admin purges the third dead letter: a job, run to success.
    async fn purge_the_third(&self) -> anyhow::Result<()> {
        let body = json!({"filter": {"id": [self.ids[2].as_str()]}});
        let purge_job = self
            .expect(
                "POST",
                &self.purge,
                Some(&self.admin.secret),
                Some(body),
                202,
            )
            .await?;
        let id = purge_job["id"].as_str().context("id")?;
        let finished = self.job_end(&format!("{}/v1/jobs/{id}", self.base)).await?;
        ensure!(
            finished["state"] == "succeeded" && finished["outcome"]["done"] == 1,
            "{finished}"
        );
        Ok(())
    }

    /// Stop the server; check that the audit log holds one record per request made, that
    /// the server logged to the audit target, and that no token is in the audit log or
    /// the server's output, nor an edited payload in the audit log; stop the consumer.
    /// The audit log's records.
    async fn finish(mut self) -> anyhow::Result<Vec<Value>> {
        let server_log = self.server.0.take().context("the server")?.stop()?;
        let audit_text = std::fs::read_to_string(&self.audit)?;
        let records: Vec<Value> = audit_text
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        let per_request = records
            .iter()
            .filter(|r| {
                r["request"]
                    .as_str()
                    .is_some_and(|q| !q.starts_with("job "))
            })
            .count();
        ensure!(
            per_request == self.requests.get(),
            "{per_request} request records for {} requests",
            self.requests.get()
        );
        ensure!(
            server_log.contains("reliq::audit"),
            "the audit target is not in the server's log"
        );
        let tokens = [
            &self.reader,
            &self.operator,
            &self.admin,
            &self.expired,
            &self.removed,
        ];
        for secret in tokens.map(|t| t.secret.as_str()) {
            ensure!(!audit_text.contains(secret), "a token is in the audit log");
            ensure!(
                !server_log.contains(secret),
                "a token is in the server's log"
            );
        }
        ensure!(
            !audit_text.contains("fixed"),
            "a payload is in the audit log"
        );
        self.handle.shutdown().await;
        Ok(records)
    }
}

/// The audit records of refused requests with HTTP status `status`.
fn refused(records: &[Value], status: u16) -> Vec<&Value> {
    records
        .iter()
        .filter(|r| r["outcome"] == "refused" && r["status"] == status)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_names_every_route_and_a_reader_gets_the_asyncapi_document()
-> anyhow::Result<()> {
    let f = fixture(4).await?;
    let openapi = format!("{}/v1/openapi.json", f.base);
    let doc = f.expect("GET", &openapi, None, None, 200).await?;
    for (method, path, _) in reliq_admin::http::ROUTES {
        ensure!(
            doc["paths"][path][method.to_ascii_lowercase()].is_object(),
            "{method} {path} missing from the OpenAPI document"
        );
    }
    // The AsyncAPI document of the server's consumer: a reader's, with its dead-letter
    // channel (the NATS DLQ subject) holding reliq's dead-letter record.
    let asyncapi = format!("{}/v1/asyncapi.json", f.base);
    f.expect("GET", &asyncapi, None, None, 401).await?;
    let doc = f
        .expect("GET", &asyncapi, Some(&f.reader.secret), None, 200)
        .await?;
    ensure!(doc["asyncapi"] == "3.0.0", "{doc}");
    let dlq = doc["channels"]
        .as_object()
        .and_then(|c| {
            c.values()
                .find(|c| c["title"] == format!("{} dead letters", f.name))
        })
        .with_context(|| format!("no dead-letter channel in {doc}"))?;
    let stream = |s: &str| {
        s.replace(
            |c: char| !c.is_ascii_alphanumeric() && c != '-' && c != '_',
            "_",
        )
    };
    ensure!(
        dlq["address"] == format!("dlq.{}.{}", stream(&f.source), stream(&f.name)),
        "{dlq}"
    );
    let message = dlq["messages"]
        .as_object()
        .and_then(|m| m.values().next())
        .context("the channel's message")?;
    let key = message["$ref"]
        .as_str()
        .and_then(|r| r.strip_prefix("#/components/messages/"))
        .context("a message reference")?;
    ensure!(
        doc["components"]["messages"][key]["headers"]["$ref"]
            == "#/components/schemas/reliqDeadLetterHeaders",
        "{doc}"
    );
    f.finish().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_a_wrong_an_expired_and_a_removed_one_are_refused_401() -> anyhow::Result<()> {
    let f = fixture(4).await?;
    let stats = f.stats.as_str();
    let no_token = f.expect("GET", stats, None, None, 401).await?;
    ensure!(no_token["error"] == "missing bearer token", "{no_token}");
    f.expect("GET", stats, Some("rlq_not-a-token"), None, 401)
        .await?;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let late = f
        .expect("GET", stats, Some(&f.expired.secret), None, 401)
        .await?;
    ensure!(late["error"] == "expired token", "{late}");
    f.expect("GET", stats, Some(&f.removed.secret), None, 200)
        .await?;
    std::fs::write(
        &f.tokens,
        [&f.reader, &f.operator, &f.admin]
            .map(|t| t.entry.as_str())
            .join("\n"),
    )?;
    f.expect("GET", stats, Some(&f.removed.secret), None, 401)
        .await?;
    let records = f.finish().await?;
    let refused = refused(&records, 401);
    ensure!(refused.len() == 4, "{refused:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_replaying_and_an_operator_purging_are_refused_403() -> anyhow::Result<()> {
    let f = fixture(4).await?;
    let dry_run = || Some(json!({"dry_run": true}));
    let forbidden = f
        .expect("POST", &f.replay, Some(&f.reader.secret), dry_run(), 403)
        .await?;
    ensure!(
        forbidden["error"]
            .as_str()
            .is_some_and(|e| e.contains("reader")),
        "{forbidden}"
    );
    f.expect("POST", &f.purge, Some(&f.operator.secret), dry_run(), 403)
        .await?;
    let records = f.finish().await?;
    let refused = refused(&records, 403);
    ensure!(refused.len() == 2, "{refused:?}");
    ensure!(
        refused
            .iter()
            .any(|r| r["actor"] == "rita-reader" && r["action"] == "replay"),
        "{refused:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_source_is_refused_400_and_an_oversized_body_413() -> anyhow::Result<()>
{
    let f = fixture(4).await?;
    let stats_without_source = format!("{}/stats", f.dlq);
    let missing = f
        .expect(
            "GET",
            &stats_without_source,
            Some(&f.reader.secret),
            None,
            400,
        )
        .await?;
    ensure!(
        missing["error"]
            .as_str()
            .is_some_and(|e| e.contains("source")),
        "{missing}"
    );
    let big = json!({ "filter": { "payload_contains": "x".repeat(4096) } });
    f.expect("POST", &f.replay, Some(&f.operator.secret), Some(big), 413)
        .await?;
    let records = f.finish().await?;
    let refused = refused(&records, 413);
    ensure!(!refused.is_empty(), "no refused 413 in {records:?}");
    Ok(())
}

/// A look creates nothing: the stats of a consumer that never subscribed are 404 (and its
/// DLQ still does not exist after); names no broker object may have — traversal-like,
/// with a space, over-long — are 400 naming the field, before any broker is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_consumer_is_404_and_creates_nothing_and_bad_names_are_400() -> anyhow::Result<()>
{
    let f = fixture(1).await?;
    let reader = Some(f.reader.secret.as_str());
    let ghost = unique("ghost");
    let stats = format!("{}/v1/consumers/{ghost}/dlq/stats?{}", f.base, f.q);
    let refused = f.expect("GET", &stats, reader, None, 404).await?;
    ensure!(
        refused["error"]
            .as_str()
            .is_some_and(|e| e.contains(&format!(
                "consumer `{ghost}` of `{}` has no dead-letter queue",
                f.source
            ))),
        "{refused}"
    );
    let entries = format!("{}/v1/consumers/{ghost}/dlq/entries?{}", f.base, f.q);
    f.expect("GET", &entries, reader, None, 404).await?;
    let broker: Arc<dyn Broker> = reliq::connect(&url("nats")).await?;
    let opened = broker
        .dead_letters(&reliq_core::Subscription::new(
            ghost.clone(),
            f.source.clone(),
        ))
        .await
        .map(drop);
    ensure!(
        matches!(opened, Err(reliq_core::BrokerError::NotFound(_))),
        "the 404 created the DLQ: {opened:?}"
    );

    let long = "g".repeat(101);
    for (consumer, query, field) in [
        ("..%2F..%2Fetc", f.q.clone(), "consumer"),
        ("bill%20ing", f.q.clone(), "consumer"),
        (long.as_str(), f.q.clone(), "consumer"),
        (
            f.name.as_str(),
            "source=orders%2F..%2Fx".to_owned(),
            "source",
        ),
    ] {
        let stats = format!("{}/v1/consumers/{consumer}/dlq/stats?{query}", f.base);
        let refused = f.expect("GET", &stats, reader, None, 400).await?;
        ensure!(
            refused["error"]
                .as_str()
                .is_some_and(|e| e.contains(&format!("invalid `{field}`"))),
            "{consumer} {query}: {refused}"
        );
    }
    f.finish().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_counts_lists_and_shows_dead_letters() -> anyhow::Result<()> {
    let f = fixture(4).await?;
    let reader = Some(f.reader.secret.as_str());
    let counted = f.expect("GET", &f.stats, reader, None, 200).await?;
    ensure!(counted["count"] == 4, "{counted}");
    let entries = format!("{}/entries?{}&max=3", f.dlq, f.q);
    let listed = f.expect("GET", &entries, reader, None, 200).await?;
    ensure!(
        listed["entries"].as_array().map(Vec::len) == Some(3),
        "{listed}"
    );
    let one = f.ids[0].as_str();
    let entry = format!("{}/entries/{one}?{}", f.dlq, f.q);
    let shown = f.expect("GET", &entry, reader, None, 200).await?;
    ensure!(shown["id"] == one, "{shown}");
    f.finish().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_dry_run_plans_and_its_replay_runs_as_a_job() -> anyhow::Result<()> {
    let f = fixture(4).await?;
    let one = f.ids[0].as_str();
    let plan = f
        .expect(
            "POST",
            &f.replay,
            Some(&f.operator.secret),
            Some(json!({"dry_run": true, "filter": {"id": [one]}})),
            200,
        )
        .await?;
    ensure!(plan["matched"] == 1 && plan["done"] == 0, "{plan}");
    f.replay_the_first().await?;
    let records = f.finish().await?;
    ensure!(
        records
            .iter()
            .filter(|r| r["action"] == "replay-finished")
            .count()
            == 1,
        "{records:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_edits_and_an_admin_plans_and_purges() -> anyhow::Result<()> {
    let f = fixture(4).await?;
    f.replay_the_first().await?;
    f.edit_the_second().await?;
    let purge_plan = f
        .expect(
            "POST",
            &f.purge,
            Some(&f.admin.secret),
            Some(json!({"dry_run": true})),
            200,
        )
        .await?;
    ensure!(purge_plan["matched"] == 2, "{purge_plan}");
    f.purge_the_third().await?;
    let left = f
        .expect("GET", &f.stats, Some(&f.reader.secret), None, 200)
        .await?;
    ensure!(left["count"] == 1, "{left}");
    let records = f.finish().await?;
    ensure!(
        records
            .iter()
            .any(|r| r["action"] == "purge" && r["actor"] == "ada-admin" && r["status"] == 202)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_listed_and_an_operator_not_a_reader_cancels_one() -> anyhow::Result<()> {
    let f = fixture(4).await?;
    let job_url = f.replay_the_first().await?;
    f.purge_the_third().await?;
    let jobs_url = format!("{}/v1/jobs", f.base);
    let jobs = f
        .expect("GET", &jobs_url, Some(&f.reader.secret), None, 200)
        .await?;
    ensure!(jobs.as_array().map(Vec::len) == Some(2), "{jobs}");
    let cancel = format!("{job_url}/cancel");
    f.expect("POST", &cancel, Some(&f.reader.secret), None, 403)
        .await?;
    f.expect("POST", &cancel, Some(&f.operator.secret), None, 200)
        .await?;
    let records = f.finish().await?;
    ensure!(
        records
            .iter()
            .filter(|r| r["action"] == "replay-finished" || r["action"] == "purge-finished")
            .count()
            == 2
    );
    let refused = refused(&records, 403);
    ensure!(refused.len() == 1, "{refused:?}");
    Ok(())
}

/// Triage of a failure group: set by an operator through the API (a reader may look, not
/// change; a bad status or an unknown field is 400 naming it), shown in `stats`, set again
/// by `reliq dlq triage` on the same store, archived groups left out of `stats` (API and
/// command) unless asked, everything kept across a server restart, and each change in
/// the audit log with what it changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn triage_set_by_api_and_command_is_kept_across_a_restart_and_audited() -> anyhow::Result<()>
{
    let mut f = fixture(4).await?;
    let stats = f
        .expect("GET", &f.stats, Some(&f.reader.secret), None, 200)
        .await?;
    let fp = stats["groups"][0]["id"]
        .as_str()
        .context("the group's fingerprint")?
        .to_owned();
    ensure!(stats["groups"][0]["status"] == "new", "{stats}");
    let triage = |base: &str| {
        format!(
            "{base}/v1/consumers/{}/dlq/groups/{fp}/triage?{}",
            f.name, f.q
        )
    };
    let group = triage(&f.base);
    let fresh = f
        .expect("GET", &group, Some(&f.reader.secret), None, 200)
        .await?;
    ensure!(
        fresh["status"] == "new" && fresh["updated_at"].is_null(),
        "{fresh}"
    );
    let change = json!({"status": "investigating", "assignee": "alice", "note": "sku dropped by the 12:03 schema change"});
    f.expect(
        "PUT",
        &group,
        Some(&f.reader.secret),
        Some(change.clone()),
        403,
    )
    .await?;
    let bad = f
        .expect(
            "PUT",
            &group,
            Some(&f.operator.secret),
            Some(json!({"status": "done"})),
            400,
        )
        .await?;
    ensure!(
        bad["error"].as_str().is_some_and(|e| e.contains("status")),
        "{bad}"
    );
    f.expect(
        "PUT",
        &group,
        Some(&f.operator.secret),
        Some(json!({"owner": "x"})),
        400,
    )
    .await?;
    let set = f
        .expect("PUT", &group, Some(&f.operator.secret), Some(change), 200)
        .await?;
    ensure!(
        set["status"] == "investigating"
            && set["assignee"] == "alice"
            && set["updated_by"] == "oscar-operator"
            && set["notes"][0]["text"] == "sku dropped by the 12:03 schema change",
        "{set}"
    );
    let stats = f
        .expect("GET", &f.stats, Some(&f.reader.secret), None, 200)
        .await?;
    ensure!(
        stats["groups"][0]["status"] == "investigating"
            && stats["groups"][0]["assignee"] == "alice",
        "{stats}"
    );

    // The command, on the same store, while the server runs.
    let db = f.audit.with_file_name("triage.sqlite");
    let nats = url("nats");
    let archived = support::json(
        support::dlq(&nats, &f.name, &f.source, &["triage", &fp, "--json"])
            .args([
                "--status",
                "archived",
                "--note",
                "kept: replayed by hand",
                "--by",
                "ola-cli",
            ])
            .arg("--triage-db")
            .arg(&db)
            .arg("--audit-log")
            .arg(&f.audit),
        0,
    )?;
    ensure!(
        archived["status"] == "archived"
            && archived["assignee"] == "alice"
            && archived["notes"].as_array().map(Vec::len) == Some(2),
        "{archived}"
    );
    let stats = f
        .expect("GET", &f.stats, Some(&f.reader.secret), None, 200)
        .await?;
    ensure!(
        stats["count"] == 4
            && stats["groups"].as_array().is_some_and(Vec::is_empty)
            && stats["archived_groups"] == 1,
        "archived, still shown: {stats}"
    );
    let with_archived = format!("{}&archived=true", f.stats);
    let all = f
        .expect("GET", &with_archived, Some(&f.reader.secret), None, 200)
        .await?;
    ensure!(all["groups"][0]["status"] == "archived", "{all}");

    // A restart: the same store, the same answers.
    drop(f.server.0.take().context("the server")?.stop()?);
    let server = Server::start(
        &nats,
        &format!("{}={}", f.name, f.source),
        &f.tokens,
        &f.audit,
    )?;
    let again = f
        .expect(
            "GET",
            &triage(&server.base),
            Some(&f.reader.secret),
            None,
            200,
        )
        .await?;
    f.server = Running(Some(server));
    ensure!(
        again["status"] == "archived"
            && again["assignee"] == "alice"
            && again["notes"][1]["author"] == "ola-cli",
        "after a restart: {again}"
    );
    let cli_stats = |extra: &[&str]| {
        let mut cmd = support::dlq(&nats, &f.name, &f.source, &["stats", "--json"]);
        cmd.arg("--triage-db").arg(&db).args(extra);
        support::json(&mut cmd, 0)
    };
    let hidden = cli_stats(&[])?;
    ensure!(
        hidden["groups"].as_array().is_some_and(Vec::is_empty) && hidden["archived_groups"] == 1,
        "{hidden}"
    );
    let shown = cli_stats(&["--archived"])?;
    ensure!(shown["groups"][0]["status"] == "archived", "{shown}");

    // The history: the API's change and the command's, each with what it changed.
    let changes: Vec<Value> = std::fs::read_to_string(&f.audit)?
        .lines()
        .map(serde_json::from_str::<Value>)
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|r| r["action"] == "triage" && r["outcome"] == "allowed")
        .collect();
    ensure!(changes.len() == 2, "triage records: {changes:?}");
    ensure!(
        changes[0]["actor"] == "oscar-operator"
            && changes[0]["detail"]["status"] == "investigating"
            && changes[0]["detail"]["assignee"] == "alice"
            && changes[0]["detail"]["fingerprint"] == fp.as_str(),
        "{}",
        changes[0]
    );
    ensure!(
        changes[1]["actor"] == "ola-cli" && changes[1]["detail"]["status"] == "archived",
        "{}",
        changes[1]
    );
    f.handle.shutdown().await;
    Ok(())
}

/// SIGTERM while a replay runs: the server lets it run for its 1 s grace, cancels it,
/// says so, and exits 0; every dead letter is either handled once by the consumer or
/// still in the DLQ — none lost, none twice — and a second replay finishes the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_during_a_replay_hands_it_back_and_loses_nothing() -> anyhow::Result<()> {
    const PARKED: usize = 40;
    let mut f = fixture(PARKED).await?;
    // 40 at 8/s: 5 s of work, more than the grace.
    let job = f
        .expect(
            "POST",
            &f.replay,
            Some(&f.operator.secret),
            Some(json!({"rate": 8})),
            202,
        )
        .await?;
    ensure!(job["id"].is_string(), "{job}");
    wait_for("the first copies handled", Duration::from_secs(30), || {
        f.effects.count() >= 3
    })
    .await?;
    let server = f.server.0.take().context("the server")?;
    let stopping = std::time::Instant::now();
    let (code, err) = server.terminate()?;
    let took = stopping.elapsed();
    eprintln!(
        "stopped after {took:?}; handled: {}; log:\n{err}",
        f.effects.count()
    );
    ensure!(
        code == Some(0) && err.contains("stopped: 0 job(s) finished, 1 handed back"),
        "exit {code:?}: {err}"
    );
    // The grace, then the copies in flight: a few seconds at most.
    ensure!(took < Duration::from_secs(6), "the stop took {took:?}");
    let handed_back = std::fs::read_to_string(&f.audit)?
        .lines()
        .map(serde_json::from_str::<Value>)
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .find(|r| r["action"] == "replay-finished")
        .context("no audit record of the replay's end")?;
    ensure!(
        handed_back["outcome"]
            .as_str()
            .is_some_and(|o| o.contains("cancel")),
        "{handed_back}"
    );

    // Every id handled at most once, and the rest still parked.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let url = url("nats");
    let stats = |f: &Fixture| {
        support::json(
            &mut support::dlq(&url, &f.name, &f.source, &["stats", "--json"]),
            0,
        )
    };
    let handled = f.effects.snapshot();
    let left = stats(&f)?["count"].as_u64().context("count")? as usize;
    ensure!(
        handled.values().all(|n| *n == 1)
            && handled.len() < PARKED
            && handled.len() + left == PARKED,
        "handled {} (max {:?} times), left {left}, of {PARKED}",
        handled.len(),
        handled.values().max()
    );
    let rest = support::json(
        &mut support::dlq(&url, &f.name, &f.source, &["replay", "--json"]),
        0,
    )?;
    ensure!(rest["done"] == left as u64, "{rest}");
    wait_for("every copy handled", Duration::from_secs(30), || {
        f.effects.count() == PARKED
    })
    .await?;
    ensure!(
        f.effects.snapshot().values().all(|n| *n == 1) && stats(&f)?["count"] == 0,
        "after the second replay: {:?}",
        f.effects.snapshot()
    );
    f.handle.shutdown().await;
    Ok(())
}

/// GET /metrics: a reader's token; the server's consumer's DLQ depth as the broker counts
/// it (the poller reads it every 500 ms). An allowed scrape is not audited, a refused one
/// is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_need_a_token_show_the_dlq_depth_and_only_refusals_are_audited()
-> anyhow::Result<()> {
    let f = fixture(1).await?;
    let metrics = format!("{}/metrics", f.base);
    let refused_scrape = f.http.get(&metrics).send().await?;
    f.requests.set(f.requests.get() + 1);
    ensure!(
        refused_scrape.status() == 401,
        "a scrape without a token: {}",
        refused_scrape.status()
    );
    let (name, source) = (&f.name, &f.source);
    let dlq_series = format!("reliq_dlq_messages{{consumer=\"{name}\",source=\"{source}\"}} 1");
    let mut scraped = String::new();
    for _ in 0..40 {
        let answer = f
            .http
            .get(&metrics)
            .bearer_auth(&f.reader.secret)
            .send()
            .await?;
        ensure!(
            answer.status() == 200,
            "a reader's scrape: {}",
            answer.status()
        );
        scraped = answer.text().await?;
        if scraped.contains(&dlq_series) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let backlog = format!("reliq_consumer_backlog_messages{{consumer=\"{name}\"");
    ensure!(
        scraped.contains(&dlq_series) && scraped.contains(&backlog),
        "no {dlq_series} in the scrape:\n{scraped}"
    );
    let records = f.finish().await?;
    let refused = refused(&records, 401);
    ensure!(
        refused.len() == 1 && refused.iter().any(|r| r["action"] == "metrics"),
        "the refused scrape is not audited: {refused:?}"
    );
    ensure!(
        !records
            .iter()
            .any(|r| r["action"] == "metrics" && r["status"] == 200),
        "an allowed scrape was audited"
    );
    Ok(())
}

/// A self-signed certificate for 127.0.0.1: (certificate PEM, key PEM).
fn test_certificate() -> anyhow::Result<(String, String)> {
    let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()])?;
    Ok((made.cert.pem(), made.signing_key.serialize_pem()))
}

/// An HTTPS client that trusts only `cert_pem`.
fn trusting(cert_pem: &str) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(cert_pem.as_bytes())?])
        .timeout(Duration::from_secs(10))
        .build()?)
}

/// `GET url`: (status, JSON body).
async fn probe(http: &reqwest::Client, url: &str) -> anyhow::Result<(u16, Value)> {
    let r = http.get(url).send().await?;
    Ok((r.status().as_u16(), r.json().await?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_over_tls_from_a_config_file_ready_follows_the_broker_and_a_new_certificate_loads()
-> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let nats: std::net::SocketAddr = url("nats")
        .trim_start_matches("nats://")
        .parse()
        .context("RELIQ_NATS_URL is nats://host:port")?;
    let proxy = reliq_integration::proxy::FaultProxy::start(nats).await?;
    let dir = tempfile::tempdir()?;
    let (cert, key) = test_certificate()?;
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert_path, &cert)?;
    std::fs::write(&key_path, &key)?;
    let tokens = dir.path().join("tokens.toml");
    std::fs::write(&tokens, token("rita-reader", "reader", None)?.entry)?;
    let config = dir.path().join("admin.toml");
    std::fs::write(
        &config,
        format!(
            "url = \"nats://{}\"\nlisten = \"127.0.0.1:0\"\ntokens = {:?}\nready_timeout = \"1s\"\n\
             job_grace = \"1s\"\n[tls]\ncert = {:?}\nkey = {:?}\nreload_every = \"200ms\"\n",
            proxy.addr(),
            tokens.display().to_string(),
            cert_path.display().to_string(),
            key_path.display().to_string(),
        ),
    )?;
    let mut child = support::reliq()
        .args(["admin", "serve", "--config"])
        .arg(&config)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().context("stdout")?),
        &mut line,
    )?;
    let base = line
        .trim()
        .strip_prefix("reliq admin API listening on ")
        .with_context(|| format!("first line: {line:?}"))?
        .to_owned();
    ensure!(base.starts_with("https://127.0.0.1:"), "{base}");

    let http = trusting(&cert)?;
    let (status, body) = probe(&http, &format!("{base}/healthz")).await?;
    ensure!(
        status == 200 && body["status"] == "alive",
        "{status} {body}"
    );
    let (status, body) = probe(&http, &format!("{base}/readyz")).await?;
    ensure!(
        status == 200 && body["status"] == "ready" && body["broker"] == "nats",
        "{status} {body}"
    );
    // Plain HTTP to the TLS port gets no answer.
    let plain = base.replacen("https://", "http://", 1);
    ensure!(
        reqwest::Client::new()
            .get(format!("{plain}/healthz"))
            .send()
            .await
            .is_err(),
        "plain HTTP answered on the TLS port"
    );

    // The broker goes silent: not ready (within the 1 s ready timeout), then ready again.
    proxy.stall();
    let started = std::time::Instant::now();
    let (status, body) = probe(&http, &format!("{base}/readyz")).await?;
    ensure!(
        status == 503 && body["status"] == "unready",
        "{status} {body}"
    );
    ensure!(
        started.elapsed() < Duration::from_secs(3),
        "503 after {:?}",
        started.elapsed()
    );
    let (status, _) = probe(&http, &format!("{base}/healthz")).await?;
    ensure!(status == 200, "alive while the broker is silent: {status}");
    proxy.resume();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = probe(&http, &format!("{base}/readyz")).await?;
        if status == 200 {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "not ready 20 s after the broker is back: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // A renewed certificate on disk is served without a restart.
    let (cert2, key2) = test_certificate()?;
    std::fs::write(&key_path, &key2)?;
    std::fs::write(&cert_path, &cert2)?;
    let renewed = trusting(&cert2)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while renewed.get(format!("{base}/healthz")).send().await.is_err() {
        ensure!(
            std::time::Instant::now() < deadline,
            "the renewed certificate is not served 10 s after it was written"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A new connection (the open ones keep the certificate they began with).
    ensure!(
        trusting(&cert)?
            .get(format!("{base}/healthz"))
            .send()
            .await
            .is_err(),
        "the old certificate is still served to new connections"
    );

    // SIGTERM: a clean stop.
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    ensure!(killed.success(), "kill -TERM failed");
    let status = child.wait()?;
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().context("stderr")?, &mut err)?;
    ensure!(status.code() == Some(0), "exit {status:?}: {err}");
    ensure!(err.contains("stopped: 0 job(s) finished"), "{err}");
    Ok(())
}

#[test]
fn a_config_file_with_an_unknown_key_or_a_bad_value_fails_at_start_naming_it() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    for (text, names) in [
        ("lisen = \"127.0.0.1:0\"\n", "lisen"),
        ("tokens = \"t.toml\"\njob_grace = \"soon\"\n", "job_grace"),
        ("tokens = \"t.toml\"\n[tls]\ncert = \"c.pem\"\n", "key"),
    ] {
        let config = dir.path().join("admin.toml");
        std::fs::write(&config, text)?;
        let (code, out, err) = support::run(
            support::reliq()
                .args(["admin", "serve", "--url", "memory://", "--config"])
                .arg(&config),
        )?;
        ensure!(code == 2, "{text}: exit {code}\n{out}{err}");
        ensure!(
            err.contains(names) && err.contains("--config"),
            "{text}: {err}"
        );
    }
    Ok(())
}

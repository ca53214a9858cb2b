//! `reliq admin serve` on NATS, over HTTP: every refusal with its status (no token, a
//! wrong one, an expired one, a removed one, a reader replaying, an operator purging), the
//! operations a role may do, jobs polled to their end, the body limit, the OpenAPI
//! document — and the audit log holding every request, with no token anywhere in the
//! server's output or its log.

mod support;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use reliq_core::Broker;
use serde_json::{Value, json};
use support::{Server, consumer, park, token, unique, url, wait_for};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_enforces_roles_runs_jobs_and_audits_every_request() -> anyhow::Result<()> {
    let url = url("nats");
    let (name, source) = (unique("api"), unique("api-src"));
    let broker: Arc<dyn Broker> = reliq::connect(&url).await?;
    let (handle, effects) = consumer(broker.clone(), &name, &source).await?;
    let ids = park(&broker, &handle, &source, 4, Duration::from_secs(60)).await?;

    let reader = token("rita-reader", "reader", None)?;
    let operator = token("oscar-operator", "operator", None)?;
    let admin = token("ada-admin", "admin", None)?;
    let expired = token("eve-expired", "operator", Some("1s"))?;
    let removed = token("rob-removed", "admin", None)?;
    let secrets = [&reader, &operator, &admin, &expired, &removed].map(|t| t.secret.clone());
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    let audit = dir.path().join("audit.jsonl");
    let all = [&reader, &operator, &admin, &expired, &removed]
        .map(|t| t.entry.as_str())
        .join("\n");
    std::fs::write(&tokens, &all)?;
    let server = Server::start(&url, &format!("{name}={source}"), &tokens, &audit)?;
    // reqwest is built without a TLS provider of its own (plain HTTP here).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let dlq = format!("{}/v1/consumers/{name}/dlq", server.base);
    let q = format!("source={source}");
    let requests = std::cell::Cell::new(0usize);
    let expect = async |method: &str,
                        path: &str,
                        token: Option<&str>,
                        body: Option<Value>,
                        status: u16|
           -> anyhow::Result<Value> {
        requests.set(requests.get() + 1);
        let (got, value) = call(&http, method, path, token, body).await?;
        ensure!(
            got == status,
            "{method} {path}: {got}, expected {status}: {value}"
        );
        Ok(value)
    };

    // The OpenAPI document names every route, no token needed.
    let doc = expect(
        "GET",
        &format!("{}/v1/openapi.json", server.base),
        None,
        None,
        200,
    )
    .await?;
    for (method, path, _) in reliq_admin::http::ROUTES {
        ensure!(
            doc["paths"][path][method.to_ascii_lowercase()].is_object(),
            "{method} {path} missing from the OpenAPI document"
        );
    }

    // Refusals.
    let stats = format!("{dlq}/stats?{q}");
    let no_token = expect("GET", &stats, None, None, 401).await?;
    ensure!(no_token["error"] == "missing bearer token", "{no_token}");
    expect("GET", &stats, Some("rlq_not-a-token"), None, 401).await?;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let late = expect("GET", &stats, Some(&expired.secret), None, 401).await?;
    ensure!(late["error"] == "expired token", "{late}");
    let replay = format!("{dlq}/replay?{q}");
    let purge = format!("{dlq}/purge?{q}");
    let forbidden = expect(
        "POST",
        &replay,
        Some(&reader.secret),
        Some(json!({"dry_run": true})),
        403,
    )
    .await?;
    ensure!(
        forbidden["error"]
            .as_str()
            .is_some_and(|e| e.contains("reader")),
        "{forbidden}"
    );
    expect(
        "POST",
        &purge,
        Some(&operator.secret),
        Some(json!({"dry_run": true})),
        403,
    )
    .await?;
    expect("GET", &stats, Some(&removed.secret), None, 200).await?;
    std::fs::write(
        &tokens,
        [&reader, &operator, &admin]
            .map(|t| t.entry.as_str())
            .join("\n"),
    )?;
    expect("GET", &stats, Some(&removed.secret), None, 401).await?;
    let missing = expect(
        "GET",
        &format!("{dlq}/stats"),
        Some(&reader.secret),
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
    expect("POST", &replay, Some(&operator.secret), Some(big), 413).await?;

    // What each role may do.
    let counted = expect("GET", &stats, Some(&reader.secret), None, 200).await?;
    ensure!(counted["count"] == 4, "{counted}");
    let listed = expect(
        "GET",
        &format!("{dlq}/entries?{q}&max=3"),
        Some(&reader.secret),
        None,
        200,
    )
    .await?;
    ensure!(
        listed["entries"].as_array().map(Vec::len) == Some(3),
        "{listed}"
    );
    let one = ids[0].as_str();
    let shown = expect(
        "GET",
        &format!("{dlq}/entries/{one}?{q}"),
        Some(&reader.secret),
        None,
        200,
    )
    .await?;
    ensure!(shown["id"] == one, "{shown}");
    let plan = expect(
        "POST",
        &replay,
        Some(&operator.secret),
        Some(json!({"dry_run": true, "filter": {"id": [one]}})),
        200,
    )
    .await?;
    ensure!(plan["matched"] == 1 && plan["done"] == 0, "{plan}");
    let job = expect(
        "POST",
        &replay,
        Some(&operator.secret),
        Some(json!({"filter": {"id": [one]}, "rate": 100})),
        202,
    )
    .await?;
    let job_id = job["id"].as_str().context("job id")?.to_owned();
    let job_url = format!("{}/v1/jobs/{job_id}", server.base);
    let (polls, finished) = job_end(&http, &job_url, &reader.secret).await?;
    requests.set(requests.get() + polls);
    ensure!(
        finished["state"] == "succeeded" && finished["outcome"]["done"] == 1,
        "{finished}"
    );
    ensure!(finished["actor"] == "oscar-operator", "{finished}");
    wait_for("the replayed copy handled", Duration::from_secs(30), || {
        effects.snapshot().contains_key(&ids[0])
    })
    .await?;
    let edit = format!("{dlq}/entries/{}/edit?{q}", ids[1].as_str());
    let edited = expect(
        "POST",
        &edit,
        Some(&operator.secret),
        Some(json!({"payload": {"order": 1, "fixed": true}})),
        200,
    )
    .await?;
    ensure!(edited["original"] == ids[1].as_str(), "{edited}");
    let purge_plan = expect(
        "POST",
        &purge,
        Some(&admin.secret),
        Some(json!({"dry_run": true})),
        200,
    )
    .await?;
    ensure!(purge_plan["matched"] == 2, "{purge_plan}");
    let purge_job = expect(
        "POST",
        &purge,
        Some(&admin.secret),
        Some(json!({"filter": {"id": [ids[2].as_str()]}})),
        202,
    )
    .await?;
    let purge_url = format!(
        "{}/v1/jobs/{}",
        server.base,
        purge_job["id"].as_str().context("id")?
    );
    let (polls, finished) = job_end(&http, &purge_url, &reader.secret).await?;
    requests.set(requests.get() + polls);
    ensure!(
        finished["state"] == "succeeded" && finished["outcome"]["done"] == 1,
        "{finished}"
    );
    let jobs = expect(
        "GET",
        &format!("{}/v1/jobs", server.base),
        Some(&reader.secret),
        None,
        200,
    )
    .await?;
    ensure!(jobs.as_array().map(Vec::len) == Some(2), "{jobs}");
    expect(
        "POST",
        &format!("{job_url}/cancel"),
        Some(&reader.secret),
        None,
        403,
    )
    .await?;
    expect(
        "POST",
        &format!("{job_url}/cancel"),
        Some(&operator.secret),
        None,
        200,
    )
    .await?;
    let left = expect("GET", &stats, Some(&reader.secret), None, 200).await?;
    ensure!(left["count"] == 1, "{left}");

    // GET /metrics: a reader's token; the server's consumer's DLQ depth as the broker
    // counts it (the poller reads it every 500 ms). An allowed scrape is not audited, a
    // refused one is.
    let metrics = format!("{}/metrics", server.base);
    let refused = http.get(&metrics).send().await?;
    requests.set(requests.get() + 1);
    ensure!(
        refused.status() == 401,
        "a scrape without a token: {}",
        refused.status()
    );
    let dlq_series = format!("reliq_dlq_messages{{consumer=\"{name}\",source=\"{source}\"}} 1");
    let mut scraped = String::new();
    for _ in 0..40 {
        let answer = http
            .get(&metrics)
            .bearer_auth(&reader.secret)
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
    ensure!(
        scraped.contains(&dlq_series)
            && scraped.contains(&format!(
                "reliq_consumer_backlog_messages{{consumer=\"{name}\""
            )),
        "no {dlq_series} in the scrape:\n{scraped}"
    );

    // The audit log: one record per request (and one per finished job), refusals with
    // their status and, for 403s, who; no token anywhere in it or in the server's output.
    let server_log = server.stop()?;
    let audit_text = std::fs::read_to_string(&audit)?;
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
        per_request == requests.get(),
        "{per_request} request records for {} requests",
        requests.get()
    );
    ensure!(
        records
            .iter()
            .filter(|r| r["action"] == "replay-finished" || r["action"] == "purge-finished")
            .count()
            == 2
    );
    let refused: Vec<&Value> = records
        .iter()
        .filter(|r| r["outcome"] == "refused")
        .collect();
    ensure!(
        refused.iter().filter(|r| r["status"] == 401).count() == 5,
        "{refused:?}"
    );
    ensure!(
        refused.iter().filter(|r| r["status"] == 403).count() == 3,
        "{refused:?}"
    );
    ensure!(
        refused
            .iter()
            .any(|r| r["status"] == 403 && r["actor"] == "rita-reader" && r["action"] == "replay"),
        "{refused:?}"
    );
    ensure!(refused.iter().any(|r| r["status"] == 413), "{refused:?}");
    ensure!(
        refused
            .iter()
            .any(|r| r["status"] == 401 && r["action"] == "metrics"),
        "the refused scrape is not audited: {refused:?}"
    );
    ensure!(
        !records
            .iter()
            .any(|r| r["action"] == "metrics" && r["status"] == 200),
        "an allowed scrape was audited"
    );
    ensure!(
        records
            .iter()
            .any(|r| r["action"] == "purge" && r["actor"] == "ada-admin" && r["status"] == 202)
    );
    ensure!(
        server_log.contains("reliq::audit"),
        "the audit target is not in the server's log"
    );
    for secret in &secrets {
        ensure!(
            !audit_text.contains(secret.as_str()),
            "a token is in the audit log"
        );
        ensure!(
            !server_log.contains(secret.as_str()),
            "a token is in the server's log"
        );
    }
    ensure!(
        !audit_text.contains("fixed"),
        "a payload is in the audit log"
    );
    handle.shutdown().await;
    Ok(())
}

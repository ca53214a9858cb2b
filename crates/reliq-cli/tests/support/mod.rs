//! What the `reliq` command's tests share: a consumer that dead-letters first-time
//! messages and takes replayed ones (once each, through an inbox), and a way to run the
//! built binary.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Read as _};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use reliq_core::{
    BoxError, Broker, Consumer, ConsumerHandle, Delivery, Destination, MemoryInbox, Message,
    MessageId, Permanent, Poison, RetryPolicy, seam::headers,
};

/// The URL of a real backend, from the environment or brokers.env.
pub fn url(backend: &str) -> String {
    reliq_integration::settings::get(&format!("RELIQ_{}_URL", backend.to_ascii_uppercase()))
}

/// A fresh name.
pub fn unique(base: &str) -> String {
    reliq_conformance::support::unique(base)
}

/// Replayed ids handled (each counted once per effect) — what the consumer's business
/// effect would be.
#[derive(Clone, Default)]
pub struct Effects(Arc<Mutex<HashMap<MessageId, u32>>>);

impl Effects {
    /// `id` handled once more.
    pub fn record(&self, id: &MessageId) {
        if let Ok(mut m) = self.0.lock() {
            *m.entry(id.clone()).or_insert(0) += 1;
        }
    }

    pub fn count(&self) -> usize {
        self.0.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn snapshot(&self) -> HashMap<MessageId, u32> {
        self.0.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

/// A consumer `consumer` of `source` on `broker`: a first-time message fails permanently
/// ("order N not found") and is dead-lettered; a replayed copy (the replay marker) is
/// handled, once per id thanks to the inbox. The same connection settings as the CLI's
/// (`reliq::connect(url)`), so both declare the same topology.
pub async fn consumer(
    broker: Arc<dyn Broker>,
    consumer: &str,
    source: &str,
) -> anyhow::Result<(ConsumerHandle, Effects)> {
    consumer_failing(broker, consumer, source, false).await
}

/// [`consumer`], whose first-time messages fail as poison ("undecodable field at byte N")
/// when `poison`, as a permanent "order N not found" otherwise.
pub async fn consumer_failing(
    broker: Arc<dyn Broker>,
    consumer: &str,
    source: &str,
    poison: bool,
) -> anyhow::Result<(ConsumerHandle, Effects)> {
    let effects = Effects::default();
    let sink = effects.clone();
    let handle = Consumer::builder(broker, consumer)
        .subscribe(source)
        .retry(RetryPolicy::tiers([Duration::from_secs(1)]).max_attempts(2))
        .max_in_flight(256)
        .inbox(Arc::new(MemoryInbox::new()))
        .start(move |d: Delivery| {
            let sink = sink.clone();
            async move {
                if d.headers().get(headers::REPLAY_COUNT).is_some() {
                    if let Ok(mut m) = sink.0.lock() {
                        *m.entry(d.id().clone()).or_insert(0) += 1;
                    }
                    return Ok(());
                }
                let n = d
                    .headers()
                    .get("x-n")
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                if poison {
                    return Err::<(), BoxError>(
                        Poison::msg(format!("undecodable field at byte {}", 10 + n)).into(),
                    );
                }
                Err::<(), BoxError>(Permanent::msg(format!("order {n} not found")).into())
            }
        })
        .await?;
    Ok((handle, effects))
}

/// Publish `n` messages to `source` (64 confirms in flight) and wait until `handle` has
/// dead-lettered all of them; their ids.
pub async fn park(
    broker: &Arc<dyn Broker>,
    handle: &ConsumerHandle,
    source: &str,
    n: usize,
    within: Duration,
) -> anyhow::Result<Vec<MessageId>> {
    let dest = Destination::new(source);
    let base = handle.stats().dead_lettered;
    let mut ids = Vec::with_capacity(n);
    let mut messages = (0..n).map(|i| {
        Message::new(format!("{{\"order\":{i}}}"))
            .with_key(format!("customer-{}", i % 5_000))
            .with_header("x-n", i.to_string())
    });
    loop {
        let batch: Vec<Message> = messages.by_ref().take(64).collect();
        if batch.is_empty() {
            break;
        }
        ids.extend(batch.iter().map(|m| m.id().clone()));
        for r in
            futures::future::join_all(batch.into_iter().map(|m| broker.publish(&dest, m))).await
        {
            r.context("publish")?;
        }
    }
    let deadline = tokio::time::Instant::now() + within;
    while handle.stats().dead_lettered < base + n as u64 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{} of {n} dead-lettered within {within:?}",
            handle.stats().dead_lettered - base
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(ids)
}

/// Wait up to `within` for `done()`.
pub async fn wait_for(what: &str, within: Duration, done: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The built `reliq` binary, with no RELIQ_* variables from the caller's environment.
pub fn reliq() -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_reliq"));
    for (k, _) in std::env::vars() {
        if k.starts_with("RELIQ_") {
            cmd.env_remove(k);
        }
    }
    cmd.env(
        "RUST_LOG",
        std::env::var("RELIQ_TEST_CLI_LOG").unwrap_or_else(|_| "warn".into()),
    );
    cmd
}

/// `reliq dlq <args> --url … --consumer … --source …`.
pub fn dlq(url: &str, consumer: &str, source: &str, args: &[&str]) -> std::process::Command {
    let mut cmd = reliq();
    cmd.arg("dlq")
        .args(args)
        .args(["--url", url, "--consumer", consumer, "--source", source]);
    cmd
}

/// Run `cmd` to its end; (exit code, stdout, stderr). A process ended by a signal has
/// code -1 and the signal at the end of its stderr.
pub fn run(cmd: &mut std::process::Command) -> anyhow::Result<(i32, String, String)> {
    use std::os::unix::process::ExitStatusExt as _;
    let out = cmd.output().context("running reliq")?;
    let mut stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if let Some(signal) = out.status.signal() {
        stderr.push_str(&format!(
            "\n(killed by signal {signal}{})",
            if out.status.core_dumped() {
                ", core dumped"
            } else {
                ""
            }
        ));
    }
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
    ))
}

/// Run `cmd` (a `--json` command) and parse its stdout; fails unless it exits `code`.
pub fn json(cmd: &mut std::process::Command, code: i32) -> anyhow::Result<serde_json::Value> {
    let (got, out, err) = run(cmd)?;
    ensure!(
        got == code,
        "exit {got}, expected {code}\nstdout: {out}\nstderr: {err}"
    );
    serde_json::from_str(&out).with_context(|| format!("stdout is not JSON: {out}\nstderr: {err}"))
}

/// Run `check` (a `reliq topology check … --fail-on any`) until it exits 0 saying the
/// topology is as planned (groups join shortly after a consumer starts), for up to 30 s;
/// any exit but 0 or 5 fails at once.
pub async fn wait_as_planned(check: impl Fn() -> std::process::Command) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (code, text, err) = run(&mut check())?;
        if code == 0 {
            ensure!(text.contains("as planned"), "{text}");
            return Ok(());
        }
        ensure!(
            code == 5 && std::time::Instant::now() < deadline,
            "exit {code}: {text}{err}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// An admin API token: the secret a client sends, and its line for the tokens file.
pub struct Token {
    /// `Authorization: Bearer` value.
    pub secret: String,
    /// The tokens file's entry (the secret's hash, name and role).
    pub entry: String,
}

/// A new token from `reliq admin token`.
pub fn token(name: &str, role: &str, expires_in: Option<&str>) -> anyhow::Result<Token> {
    let mut cmd = reliq();
    cmd.args(["admin", "token", "--name", name, "--role", role, "--json"]);
    if let Some(e) = expires_in {
        cmd.args(["--expires-in", e]);
    }
    let made = json(&mut cmd, 0)?;
    Ok(Token {
        secret: made["token"].as_str().context("token")?.to_owned(),
        entry: made["entry"].as_str().context("entry")?.to_owned(),
    })
}

/// The server, and what it printed (read after it is stopped).
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
}

impl Server {
    /// `reliq admin serve` on `url` for `consumer`, on a free port.
    pub fn start(
        url: &str,
        consumer: &str,
        tokens: &std::path::Path,
        audit: &std::path::Path,
    ) -> anyhow::Result<Self> {
        let mut child = reliq()
            .env("RUST_LOG", "info")
            .args([
                "admin",
                "serve",
                "--url",
                url,
                "--listen",
                "127.0.0.1:0",
                "--max-body-bytes",
                "2048",
                "--metrics-interval",
                "500ms",
                // A stop lets running jobs finish for 1 s, then hands them back.
                "--job-grace",
                "1s",
                "--consumer",
                consumer,
            ])
            .arg("--tokens")
            .arg(tokens)
            .arg("--audit-log")
            .arg(audit)
            // Triage kept beside the audit log.
            .arg("--triage-db")
            .arg(audit.with_file_name("triage.sqlite"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting reliq admin serve")?;
        let stdout = child.stdout.take().context("stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let base = line
            .trim()
            .strip_prefix("reliq admin API listening on ")
            .with_context(|| format!("unexpected first line: {line:?}"))?
            .to_owned();
        Ok(Self { child, base })
    }

    /// Stop it as a service manager does (SIGTERM) and wait: its exit code and
    /// everything it wrote to stderr.
    pub fn terminate(mut self) -> anyhow::Result<(Option<i32>, String)> {
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        ensure!(sent.success(), "kill -TERM failed");
        let status = self.child.wait()?;
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            e.read_to_string(&mut err)?;
        }
        Ok((status.code(), err))
    }

    /// Stop it; everything it wrote to stderr.
    pub fn stop(mut self) -> anyhow::Result<String> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            e.read_to_string(&mut err)?;
        }
        Ok(err)
    }
}

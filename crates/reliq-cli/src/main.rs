//! `reliq`: a consumer's dead letters on any broker, from a terminal or a script.
//!
//! ```text
//! reliq dlq stats   --url amqp://… --consumer inventory --source orders
//! reliq dlq ls      … [filters] [--cursor C] [--max N]
//! reliq dlq show    … <id>
//! reliq dlq replay  … [filters] [--dry-run] [--rate N] [--limit N] [--target consumer|original]
//! reliq dlq edit    … <id> --payload-file F [--header k=v]…
//! reliq dlq purge   … [filters] [--dry-run] [--yes]
//! reliq topology plan  --url … --consumer inventory --source orders [--retry-tiers 1s,30s] [--delivery-limit N] …
//! reliq topology check … [--fail-on breaking|any]
//! reliq admin serve --url … --listen 127.0.0.1:8080 --tokens tokens.toml [--audit-log audit.jsonl]
//! reliq admin token --name alice --role operator [--expires-in 90d]
//! ```
//!
//! Every command takes `--json` (one JSON document on stdout; progress and logs go to
//! stderr). Exit codes: 0 done; 1 failed (broker, file); 2 bad usage or input (the error
//! names the flag); 3 incomplete (a replay or purge left matching entries in the DLQ, or
//! was interrupted); 4 no such entry; 5 the broker's topology differs from the consumer's
//! plan (`topology check`: a breaking difference, or any with `--fail-on any`).

mod args;
mod asyncapi;
mod fold;
mod guard;
mod progress;
mod render;
mod serve;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use reliq_admin::{AdminError, Dlq, EditRequest, PurgeRequest, ReplayRequest, Run};
use tokio_util::sync::CancellationToken;

use crate::args::{
    AdminCommand, BrokerArgs, Cli, Command, DlqCommand, FailOn, Target, TopologyCommand,
};

/// Exit codes (documented in the module docs and `--help`).
const FAILED: u8 = 1;
const BAD_INPUT: u8 = 2;
const INCOMPLETE: u8 = 3;
const NOT_FOUND: u8 = 4;
const DRIFT: u8 = 5;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A service's log is every line (journald, a collector); a command's is folded.
    let serving = matches!(
        &cli.command,
        Command::Admin {
            command: AdminCommand::Serve(_)
        }
    );
    let folded = logs(cli.verbose, !serving);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("reliq: cannot start the async runtime: {e}");
            return ExitCode::from(FAILED);
        }
    };
    let result = runtime.block_on(run(cli));
    // A request given up on (a broker not reached in time) may still wait in a blocking
    // client call: the command's answer does not wait for it.
    runtime.shutdown_timeout(std::time::Duration::from_millis(500));
    if let Some(fold) = folded {
        let (lines, causes) = fold.held_back();
        if lines > 0 {
            eprintln!(
                "reliq: {lines} repeats of {causes} log line(s) above not shown (-v shows every line)"
            );
        }
    }
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("reliq: {}", e.message);
            ExitCode::from(e.code)
        }
    }
}

/// Logs to stderr (stdout is the command's answer): warnings and up, folded to one line
/// per cause (see [`fold`]) when `fold`; `-v` every line from info up, `-vv` from debug.
/// `RUST_LOG` sets the level instead. Colours only on a terminal.
fn logs(verbose: u8, fold: bool) -> Option<fold::Fold> {
    use tracing_subscriber::prelude::*;
    let level = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let folding = (fold && verbose == 0).then(fold::Fold::default);
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(folding.clone());
    tracing_subscriber::registry()
        .with(filter)
        .with(lines)
        .init();
    folding
}

/// A command's failure: what to print and the exit code.
struct Failure {
    message: String,
    code: u8,
}

impl From<AdminError> for Failure {
    fn from(e: AdminError) -> Self {
        let code = match &e {
            AdminError::InvalidInput { .. } => BAD_INPUT,
            AdminError::Reencode(e)
                if !matches!(e, reliq_contracts::ReencodeError::Registry(_)) =>
            {
                BAD_INPUT
            }
            AdminError::NotFound { .. }
            | AdminError::NoSuchJob(_)
            | AdminError::Broker(reliq::BrokerError::NotFound(_)) => NOT_FOUND,
            _ => FAILED,
        };
        Self {
            message: e.to_string(),
            code,
        }
    }
}

fn bad_input(message: impl Into<String>) -> Failure {
    Failure {
        message: message.into(),
        code: BAD_INPUT,
    }
}

fn failed(message: impl Into<String>) -> Failure {
    Failure {
        message: message.into(),
        code: FAILED,
    }
}

async fn connect(target: &Target) -> Result<Dlq, Failure> {
    // Names checked before connecting: a bad one is bad input, and reaches no broker.
    let subscription = reliq::Subscription::new(target.consumer.clone(), target.source.clone());
    subscription
        .check_names()
        .map_err(|e| bad_input(e.to_string()))?;
    Ok(Dlq::new(
        connect_broker(&target.broker, Reach::Answered).await?,
        subscription,
    )?)
}

/// How far [`connect_broker`] goes before it hands the broker over.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// The client made (a command that only computes, like `topology plan`; a server
    /// that starts before its broker and says so on `/readyz`).
    Client,
    /// The broker answered a ping.
    Answered,
}

/// The broker `args` names, within `--connect-timeout`: a broker that is down, or a
/// listener that never answers, ends the command then with one line naming the URL
/// (the client library's own reconnect loop would otherwise set the pace).
pub(crate) async fn connect_broker(
    args: &BrokerArgs,
    reach: Reach,
) -> Result<Arc<dyn reliq::Broker>, Failure> {
    let url = args.url()?;
    let bound = *args.connect_timeout;
    let connecting = async {
        let broker = reliq::connect(&url).await.map_err(|e| {
            let code = match e {
                reliq::ConnectError::NoScheme { .. }
                | reliq::ConnectError::UnknownScheme { .. }
                | reliq::ConnectError::FeatureDisabled { .. } => BAD_INPUT,
                _ => FAILED,
            };
            Failure {
                message: format!("connecting to {}: {}", redact(&url), reliq::ErrorChain(&e)),
                code,
            }
        })?;
        if reach == Reach::Answered {
            broker.ping().await.map_err(|e| {
                failed(format!(
                    "cannot reach {}: {}",
                    redact(&url),
                    reliq::ErrorChain(&e)
                ))
            })?;
        }
        Ok(broker)
    };
    tokio::time::timeout(bound, connecting)
        .await
        .unwrap_or_else(|_| {
            Err(failed(format!(
                "cannot reach {} within {} (--connect-timeout)",
                redact(&url),
                humantime::format_duration(bound)
            )))
        })
}

/// The process-wide Prometheus recorder, with reliq's histogram buckets; its upkeep
/// (draining histograms) runs every 5 s.
fn metrics_recorder() -> Result<metrics_exporter_prometheus::PrometheusHandle, Failure> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            reliq::metrics::DURATION_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(reliq::metrics::BATCH_SIZE.into()),
                reliq::metrics::BATCH_SIZE_BUCKETS,
            )
        })
        .map_err(|e| failed(format!("metrics buckets: {e}")))?
        .install_recorder()
        .map_err(|e| failed(format!("installing the metrics recorder: {e}")))?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// The URL without its secrets, for messages.
fn redact(url: &str) -> String {
    reliq::secrets::redact_url(url)
}

fn print_json(value: &impl serde::Serialize) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(value).map_err(|e| failed(e.to_string()))?;
    println!("{text}");
    Ok(())
}

/// Ctrl-C cancels `token` (the run stops after its copies in flight and says what it did).
fn cancel_on_ctrl_c(token: CancellationToken) {
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("reliq: interrupted; finishing the copies in flight");
            token.cancel();
        }
    });
}

/// `dlq` decoding (and re-encoding) registry-framed payloads with the registry at `url`.
fn with_registry(dlq: Dlq, url: Option<String>) -> Result<Dlq, Failure> {
    let Some(url) = url else { return Ok(dlq) };
    let registry = reliq_contracts::SchemaRegistry::new(&url)
        .map_err(|e| bad_input(format!("--schema-registry: {e}")))?;
    Ok(dlq.with_schema_registry(Arc::new(registry)))
}

async fn run(cli: Cli) -> Result<u8, Failure> {
    match cli.command {
        Command::Dlq { command } => dlq(*command).await,
        Command::Topology { command } => topology(command).await,
        Command::Asyncapi(args) => asyncapi::asyncapi(*args).await,
        Command::Admin { command } => admin(command).await,
    }
}

async fn topology(command: TopologyCommand) -> Result<u8, Failure> {
    match command {
        TopologyCommand::Plan { subscription } => {
            let broker = connect_broker(&subscription.target.broker, Reach::Client).await?;
            let plan = broker
                .plan(&subscription.subscription())
                .await
                .map_err(|e| failed(format!("planning: {}", reliq::ErrorChain(&e))))?;
            answer(subscription.target.json, &plan, |p| print!("{p}"))?;
            Ok(0)
        }
        TopologyCommand::Check {
            subscription,
            fail_on,
        } => {
            let broker = connect_broker(&subscription.target.broker, Reach::Answered).await?;
            let report = broker
                .check_topology(&subscription.subscription())
                .await
                .map_err(|e| {
                    let code = match e {
                        reliq::BrokerError::Config { .. } => BAD_INPUT,
                        _ => FAILED,
                    };
                    Failure {
                        message: format!("checking the topology: {}", reliq::ErrorChain(&e)),
                        code,
                    }
                })?;
            answer(subscription.target.json, &report, |r| print!("{r}"))?;
            let fails = match fail_on {
                FailOn::Breaking => report.is_breaking(),
                FailOn::Any => !report.drift.is_empty(),
            };
            Ok(if fails { DRIFT } else { 0 })
        }
        TopologyCommand::Permissions {
            subscription,
            principal,
            publish,
            operator,
        } => {
            let broker = connect_broker(&subscription.target.broker, Reach::Client).await?;
            let mut access = reliq::Access::consumer(subscription.subscription());
            access.publishes = publish;
            access.principal = principal;
            access.operator = operator;
            let permissions = broker.permissions(&access).await.map_err(|e| Failure {
                message: format!("listing the permissions: {}", reliq::ErrorChain(&e)),
                code: BAD_INPUT,
            })?;
            answer(subscription.target.json, &permissions, |p| print!("{p}"))?;
            Ok(0)
        }
    }
}

async fn dlq(command: DlqCommand) -> Result<u8, Failure> {
    match command {
        DlqCommand::Stats {
            target,
            filter,
            triage_db,
            archived,
        } => {
            // A read opens the store it is given, never a new one (before the broker is
            // asked: a mistyped path is bad input).
            let store = match &triage_db {
                Some(path) => Some(reliq_admin::TriageStore::open_existing(path).await?),
                None => None,
            };
            let dlq = connect(&target).await?;
            let mut stats = dlq.stats(&filter.spec()).await?;
            if let Some(store) = &store {
                let triage = store.statuses(&target.consumer).await?;
                stats.annotate(&triage, archived);
            }
            answer(target.json, &stats, render::stats)?;
            Ok(0)
        }
        DlqCommand::Triage {
            target,
            fingerprint,
            status,
            assignee,
            note,
            triage_db,
            audit_log,
            by,
        } => {
            // Names checked as every command does; the broker is not asked.
            reliq::Subscription::new(target.consumer.clone(), target.source.clone())
                .check_names()
                .map_err(|e| bad_input(e.to_string()))?;
            let store = reliq_admin::TriageStore::open(&triage_db).await?;
            let triage = if status.is_none() && assignee.is_none() && note.is_none() {
                store.get(&target.consumer, &fingerprint).await?
            } else {
                let change = reliq_admin::TriageChange {
                    status: status.as_deref().map(str::parse).transpose()?,
                    assignee,
                    note,
                };
                let triage = store
                    .change(&target.consumer, &fingerprint, &by, &change)
                    .await?;
                if let Some(path) = &audit_log {
                    reliq_admin::AuditLog::to_file(path)?.write(reliq_admin::AuditRecord {
                        actor: Some(by.clone()),
                        request: "reliq dlq triage".into(),
                        action: "triage".into(),
                        consumer: Some(target.consumer.clone()),
                        outcome: "allowed",
                        status: 200,
                        detail: Some(change.audit_detail(&fingerprint)),
                        ..reliq_admin::AuditRecord::default()
                    });
                }
                triage
            };
            answer(target.json, &triage, render::triage)?;
            Ok(0)
        }
        DlqCommand::Ls {
            target,
            filter,
            cursor,
            max,
        } => {
            let dlq = connect(&target).await?;
            let page = dlq
                .list(
                    &filter.spec(),
                    &reliq::Cursor::from(cursor.unwrap_or_default()),
                    max as usize,
                )
                .await?;
            answer(target.json, &page, render::list)?;
            Ok(0)
        }
        DlqCommand::Show {
            target,
            id,
            schema_registry,
        } => {
            let dlq = with_registry(connect(&target).await?, schema_registry)?;
            let entry = dlq.show(&id).await?;
            answer(target.json, &entry, render::detail)?;
            Ok(0)
        }
        DlqCommand::Replay {
            target,
            filter,
            dry_run,
            rate,
            rate_start,
            ramp,
            guard_metrics,
            max_failure_share,
            guard_every,
            guard_min_sample,
            to,
        } => {
            if !(0.0..=1.0).contains(&max_failure_share) {
                return Err(bad_input(format!(
                    "--max-failure-share {max_failure_share}: a share between 0 and 1"
                )));
            }
            let mut dlq = connect(&target).await?;
            if let Some(url) = guard_metrics {
                let guard = guard::FailureShareGuard::new(
                    url,
                    target.consumer.clone(),
                    max_failure_share,
                    guard_min_sample,
                )
                .map_err(failed)?;
                dlq = dlq.with_guard(*guard_every, Arc::new(guard));
            }
            let run = Run::Replay(ReplayRequest {
                filter: filter.spec(),
                dry_run,
                rate,
                target: Some(to.as_str().to_owned()),
                rate_start,
                ramp: ramp.map(|r| r.to_string()),
            });
            execute(&dlq, run, target.json).await
        }
        DlqCommand::Edit {
            target,
            id,
            payload_file,
            header,
            value_file,
            schema_registry,
        } => {
            let dlq = with_registry(connect(&target).await?, schema_registry)?;
            let read = |flag: &str, path: &std::path::Path| {
                std::fs::read(path)
                    .map_err(|e| bad_input(format!("--{flag} `{}`: {e}", path.display())))
            };
            let payload = match payload_file {
                Some(path) => Some(bytes::Bytes::from(read("payload-file", &path)?)),
                None => None,
            };
            let value = match value_file {
                Some(path) => Some(serde_json::from_slice(&read("value-file", &path)?).map_err(
                    |e| bad_input(format!("--value-file `{}`: not JSON: {e}", path.display())),
                )?),
                None => None,
            };
            if payload.is_none() && value.is_none() && header.is_empty() {
                return Err(bad_input(
                    "edit needs a correction: --payload-file or --value-file, and/or --header",
                ));
            }
            let request = EditRequest {
                payload,
                value,
                headers: header,
            };
            let outcome = dlq.edit(&id, &request).await?;
            if target.json {
                print_json(&outcome)?;
            } else {
                println!(
                    "replayed a corrected copy {} of {} (its causation id); {} removed from the DLQ",
                    outcome.copy, outcome.original, outcome.original
                );
            }
            Ok(0)
        }
        DlqCommand::Purge {
            target,
            filter,
            dry_run,
            yes,
        } => {
            let dlq = connect(&target).await?;
            let spec = filter.spec();
            spec.to_filter(std::time::SystemTime::now())?;
            if !dry_run && !yes {
                confirm_purge(&dlq, &spec).await?;
            }
            let run = Run::Purge(PurgeRequest {
                filter: spec,
                dry_run,
            });
            execute(&dlq, run, target.json).await
        }
    }
}

/// Run a replay or purge with a progress reporter and Ctrl-C as its cancel; print the
/// outcome. Exit 0 when everything matching went, 3 when some was left or interrupted.
async fn execute(dlq: &Dlq, run: Run, json: bool) -> Result<u8, Failure> {
    run.filter().to_filter(std::time::SystemTime::now())?;
    // The bar's length; a count can cost a read of the whole DLQ, so only for a bar.
    let total = if progress::draws_a_bar(json) {
        dlq.count().await.ok().map(|c| c.count)
    } else {
        None
    };
    let bar = progress::Reporter::start(run.operation(), total, json);
    let cancel = CancellationToken::new();
    cancel_on_ctrl_c(cancel.clone());
    let outcome = dlq.run(&run, bar.callback(), cancel).await;
    bar.finish();
    let outcome = outcome?;
    answer(json, &outcome, render::outcome)?;
    Ok(if outcome.complete() { 0 } else { INCOMPLETE })
}

/// Print `value` as JSON or, for a person, with `text`.
fn answer<T: serde::Serialize>(
    json: bool,
    value: &T,
    text: impl FnOnce(&T),
) -> Result<(), Failure> {
    if json {
        print_json(value)
    } else {
        text(value);
        Ok(())
    }
}

/// A purge without `--yes` asks on a terminal, and refuses elsewhere.
async fn confirm_purge(dlq: &Dlq, spec: &reliq_admin::FilterSpec) -> Result<(), Failure> {
    if !std::io::stdin().is_terminal() {
        return Err(bad_input(
            "purge removes dead letters for good: pass --yes (or --dry-run first) when not at a terminal",
        ));
    }
    let plan = dlq
        .purge(
            &PurgeRequest {
                filter: spec.clone(),
                dry_run: true,
            },
            |_| {},
            CancellationToken::new(),
        )
        .await?;
    eprint!(
        "Purge {} dead letters of consumer `{}` for good? Type the consumer name to confirm: ",
        plan.matched,
        dlq.consumer()
    );
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin()
        .read_line(&mut answer)
        .map_err(|e| failed(e.to_string()))?;
    if answer.trim() != dlq.consumer() {
        return Err(bad_input("not confirmed; nothing purged"));
    }
    Ok(())
}

async fn admin(command: AdminCommand) -> Result<u8, Failure> {
    match command {
        AdminCommand::Serve(args) => serve::serve(*args).await,
        AdminCommand::Token {
            name,
            role,
            expires_in,
            json,
        } => {
            let role: reliq_admin::Role = role.parse()?;
            let expires_at = expires_in.map(|d| std::time::SystemTime::now() + *d);
            let (token, entry) = reliq_admin::new_token(&name, role, expires_at)?;
            if json {
                print_json(&serde_json::json!({ "token": token, "entry": entry }))?;
            } else {
                println!("token (shown once; give it to {name}): {token}");
                println!("\nadd to the tokens file:\n{entry}");
            }
            Ok(0)
        }
    }
}

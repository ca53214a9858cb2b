//! `reliq admin serve`: its settings from flags, the environment and a TOML file (in
//! that order of precedence, then the defaults), and the server's life: start, serve,
//! stop on SIGTERM or Ctrl-C.
//!
//! The file takes the flags' names with `_` for `-`:
//!
//! ```toml
//! url_file = "/run/secrets/reliq-url"     # or url = "…", or backend = "kafka"
//! listen = "0.0.0.0:8443"
//! tokens = "/etc/reliq/tokens.toml"
//! audit_log = "/var/log/reliq/audit.jsonl"
//! triage_db = "/var/lib/reliq/triage.sqlite"
//! schema_registry = "https://registry.example.com/apis/ccompat/v7"
//! consumers = ["billing=orders@1s,30s", "shipping=orders"]
//! ready_timeout = "3s"
//! job_grace = "30s"
//!
//! [tls]
//! cert = "/etc/reliq/tls/tls.crt"
//! key = "/etc/reliq/tls/tls.key"
//! reload_every = "30s"
//!
//! [oidc]                                   # single sign-on for the console
//! issuer = "https://login.example.com/realms/ops"
//! client_id = "reliq-console"
//! client_secret_file = "/run/secrets/reliq-oidc"
//! redirect_url = "https://reliq.example.com/console/oidc/callback"
//! roles_claim = "roles"                    # or a dotted path: realm_access.roles
//! [oidc.roles]
//! reader = ["reliq-reader"]
//! operator = ["reliq-operator"]
//! admin = ["reliq-admin"]
//! ```
//!
//! An unknown key or a value that does not parse fails at start naming it (exit 2).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use reliq_admin::{ServeOptions, TlsFiles};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::args::{BrokerArgs, ServeArgs};
use crate::{Failure, bad_input, failed, metrics_recorder};

/// The config file, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServeFile {
    url: Option<String>,
    url_file: Option<PathBuf>,
    backend: Option<String>,
    listen: Option<String>,
    tokens: Option<PathBuf>,
    audit_log: Option<PathBuf>,
    triage_db: Option<PathBuf>,
    schema_registry: Option<String>,
    max_body_bytes: Option<usize>,
    #[serde(default)]
    consumers: Vec<String>,
    secure_cookies: Option<bool>,
    ready_timeout: Option<String>,
    job_grace: Option<String>,
    hand_back: Option<String>,
    request_grace: Option<String>,
    metrics_interval: Option<String>,
    topology_interval: Option<String>,
    tls: Option<TlsFile>,
    oidc: Option<reliq_admin::OidcSettings>,
}

/// The file's `[tls]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsFile {
    cert: PathBuf,
    key: PathBuf,
    reload_every: Option<String>,
}

/// Every setting, resolved.
#[derive(Debug)]
struct Settings {
    broker: BrokerArgs,
    listen: String,
    tokens: PathBuf,
    audit_log: Option<PathBuf>,
    triage_db: Option<PathBuf>,
    schema_registry: Option<String>,
    consumers: Vec<String>,
    secure_cookies: bool,
    ready_timeout: Duration,
    metrics_interval: Duration,
    topology_interval: Duration,
    oidc: Option<reliq_admin::OidcSettings>,
    options: ServeOptions,
}

fn read_file(path: &Path) -> Result<ServeFile, Failure> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad_input(format!("--config {}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| {
        // The message only (it names the key): toml's full report quotes the line, and
        // that line may be `url = "…"` with a password in it.
        bad_input(format!("--config {}: {}", path.display(), e.message()))
    })
}

/// A duration from the flags or else the file (`field` names it in an error).
fn duration(
    flag: Option<humantime::Duration>,
    file: Option<&str>,
    field: &str,
    default: Duration,
) -> Result<Duration, Failure> {
    if let Some(d) = flag {
        return Ok(*d);
    }
    match file {
        None => Ok(default),
        Some(text) => humantime::parse_duration(text)
            .map_err(|e| bad_input(format!("--config: `{field}` = \"{text}\": {e}"))),
    }
}

fn resolve(args: ServeArgs) -> Result<Settings, Failure> {
    let mut file = match &args.config {
        Some(path) => read_file(path)?,
        None => ServeFile::default(),
    };
    let oidc = oidc_settings(&args, file.oidc.take())?;
    let flags_name_a_broker = args.broker.url.is_some()
        || args.broker.url_file.is_some()
        || args.broker.backend.is_some();
    let broker = if flags_name_a_broker {
        args.broker
    } else {
        BrokerArgs {
            url: file.url.clone(),
            url_file: file.url_file.clone(),
            backend: file.backend.clone(),
            connect_timeout: args.broker.connect_timeout,
        }
    };
    let tokens = args.tokens.or(file.tokens).ok_or_else(|| {
        bad_input("which tokens? pass --tokens (or RELIQ_ADMIN_TOKENS), or `tokens` in --config")
    })?;
    let tls = match (args.tls_cert, args.tls_key, file.tls) {
        (Some(cert), Some(key), file_tls) => {
            Some((cert, key, file_tls.and_then(|t| t.reload_every)))
        }
        (None, None, Some(t)) => Some((t.cert, t.key, t.reload_every)),
        // clap requires both flags together.
        _ => None,
    };
    let tls = match tls {
        Some((cert, key, reload_every)) => Some(TlsFiles {
            cert,
            key,
            reload_every: duration(
                args.tls_reload_every,
                reload_every.as_deref(),
                "tls.reload_every",
                Duration::from_secs(30),
            )?,
        }),
        None => None,
    };
    let defaults = ServeOptions::default();
    let options = ServeOptions {
        limits: reliq_admin::http::Limits {
            max_body_bytes: args
                .max_body_bytes
                .or(file.max_body_bytes)
                .unwrap_or(defaults.limits.max_body_bytes),
        },
        job_grace: duration(
            args.job_grace,
            file.job_grace.as_deref(),
            "job_grace",
            defaults.job_grace,
        )?,
        hand_back: duration(
            args.hand_back,
            file.hand_back.as_deref(),
            "hand_back",
            defaults.hand_back,
        )?,
        request_grace: duration(
            args.request_grace,
            file.request_grace.as_deref(),
            "request_grace",
            defaults.request_grace,
        )?,
        tls,
    };
    Ok(Settings {
        broker,
        listen: args
            .listen
            .or(file.listen)
            .unwrap_or_else(|| "127.0.0.1:8080".into()),
        tokens,
        audit_log: args.audit_log.or(file.audit_log),
        triage_db: args.triage_db.or(file.triage_db),
        schema_registry: args.schema_registry.or(file.schema_registry),
        consumers: if args.consumers.is_empty() {
            file.consumers
        } else {
            args.consumers
        },
        secure_cookies: args.secure_cookies
            || file.secure_cookies.unwrap_or(false)
            || options.tls.is_some(),
        ready_timeout: duration(
            args.ready_timeout,
            file.ready_timeout.as_deref(),
            "ready_timeout",
            Duration::from_secs(3),
        )?,
        metrics_interval: duration(
            args.metrics_interval,
            file.metrics_interval.as_deref(),
            "metrics_interval",
            Duration::from_secs(15),
        )?,
        topology_interval: duration(
            args.topology_interval,
            file.topology_interval.as_deref(),
            "topology_interval",
            Duration::from_secs(300),
        )?,
        oidc,
        options,
    })
}

/// The `[oidc]` table with the flags (and environment) over it; flags alone need the
/// issuer, the client id and the redirect URL.
fn oidc_settings(
    args: &ServeArgs,
    file: Option<reliq_admin::OidcSettings>,
) -> Result<Option<reliq_admin::OidcSettings>, Failure> {
    let flagged = args.oidc_issuer.is_some()
        || args.oidc_client_id.is_some()
        || args.oidc_redirect_url.is_some()
        || args.oidc_client_secret_file.is_some();
    let mut settings = match (file, flagged) {
        (Some(settings), _) => settings,
        (None, false) => return Ok(None),
        (None, true) => {
            let need = |value: &Option<String>, flag: &str| {
                value.clone().ok_or_else(|| {
                    bad_input(format!(
                        "single sign-on needs {flag} (or `[oidc]` in --config)"
                    ))
                })
            };
            let mut table = toml::Table::new();
            table.insert(
                "issuer".into(),
                need(&args.oidc_issuer, "--oidc-issuer")?.into(),
            );
            table.insert(
                "client_id".into(),
                need(&args.oidc_client_id, "--oidc-client-id")?.into(),
            );
            table.insert(
                "redirect_url".into(),
                need(&args.oidc_redirect_url, "--oidc-redirect-url")?.into(),
            );
            // The file's defaults (scopes, claims, role map) for what the flags leave out.
            table
                .try_into()
                .map_err(|e: toml::de::Error| bad_input(format!("oidc: {}", e.message())))?
        }
    };
    if let Some(issuer) = &args.oidc_issuer {
        settings.issuer = issuer.clone();
    }
    if let Some(id) = &args.oidc_client_id {
        settings.client_id = id.clone();
    }
    if let Some(url) = &args.oidc_redirect_url {
        settings.redirect_url = url.clone();
    }
    if let Some(path) = &args.oidc_client_secret_file {
        settings.client_secret_file = Some(path.clone());
    }
    if settings.client_secret_file.is_none() {
        settings.client_secret = args.oidc_client_secret.clone();
    }
    Ok(Some(settings))
}

/// Resolves when the process is asked to stop: SIGTERM (systemd, Kubernetes) or SIGINT.
async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; stop with Ctrl-C");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// `reliq admin serve`.
pub(crate) async fn serve(args: ServeArgs) -> Result<u8, Failure> {
    let settings = resolve(args)?;
    let consumers = settings
        .consumers
        .iter()
        .map(|spec| reliq_admin::http::parse_consumer(spec))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(tls) = &settings.options.tls {
        // A bad certificate fails before anything connects, naming the file.
        reliq_admin::load_tls(tls).map_err(|e| bad_input(e.to_string()))?;
    }
    // Bad single sign-on settings fail here too, naming the field.
    let oidc = settings.oidc.map(reliq_admin::Oidc::new).transpose()?;
    // The server starts before its broker answers (`/readyz` says whether it does).
    let connected = crate::connect_broker(&settings.broker, crate::Reach::Client).await?;
    let tokens = reliq_admin::Tokens::open(&settings.tokens)?;
    let audit = match &settings.audit_log {
        Some(path) => reliq_admin::AuditLog::to_file(path)?,
        None => reliq_admin::AuditLog::tracing_only(),
    };
    let listener = std::net::TcpListener::bind(&settings.listen)
        .map_err(|e| bad_input(format!("--listen `{}`: {e}", settings.listen)))?;
    let bound = listener.local_addr().map_err(|e| failed(e.to_string()))?;
    let scheme = if settings.options.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let metrics = metrics_recorder()?;
    let stop = CancellationToken::new();
    let _stop_on_exit = stop.clone().drop_guard();
    tokio::spawn(
        reliq::BacklogGauges::new(connected.clone(), consumers.clone())
            .every(settings.metrics_interval)
            .check_topology_every(settings.topology_interval)
            .run(stop.clone()),
    );
    let mut state = reliq_admin::http::AdminState::new(connected, tokens, audit)
        .with_consumers(consumers)
        .with_metrics(metrics)
        .with_ready_timeout(settings.ready_timeout)
        .secure_cookies(settings.secure_cookies);
    if let Some(path) = &settings.triage_db {
        state = state.with_triage(reliq_admin::TriageStore::open(path).await?);
    }
    if let Some(oidc) = oidc {
        state = state.with_oidc(oidc);
    }
    if let Some(url) = &settings.schema_registry {
        let registry = reliq_contracts::SchemaRegistry::new(url)
            .map_err(|e| bad_input(format!("schema_registry: {e}")))?;
        state = state.with_schema_registry(Arc::new(registry));
    }
    let state = Arc::new(state);
    // The one line a supervisor (or a test) waits for.
    println!("reliq admin API listening on {scheme}://{bound}");
    eprintln!("web console: {scheme}://{bound}/console/");
    let _ = std::io::stdout().flush();
    let drained = reliq_admin::serve(listener, state, settings.options, stop_signal())
        .await
        .map_err(|e| failed(format!("serving: {e}")))?;
    eprintln!(
        "stopped: {} job(s) finished, {} handed back (cancelled; their remaining entries stay in the DLQ), {} abandoned",
        drained.finished, drained.handed_back, drained.abandoned
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documented example is a file `serve` takes: every key known, every value read.
    #[test]
    fn the_deploy_example_parses_with_its_oidc_table() -> Result<(), toml::de::Error> {
        let file: ServeFile = toml::from_str(include_str!("../../../deploy/admin.toml.example"))?;
        assert_eq!(file.consumers.len(), 2);
        assert!(file.tls.is_some());
        let oidc = file.oidc.expect("the example's [oidc] table");
        assert_eq!(oidc.client_id, "reliq-console");
        assert_eq!(oidc.roles.admin, ["reliq-admin"]);
        // Valid settings, but for the secret file (not on this machine).
        let oidc = reliq_admin::OidcSettings {
            client_secret_file: None,
            client_secret: Some("x".into()),
            ..oidc
        };
        assert!(reliq_admin::Oidc::new(oidc).is_ok());
        Ok(())
    }
}

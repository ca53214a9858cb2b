//! The admin API as a service: plain HTTP or its own TLS (rustls; the certificate files
//! are re-read when they change, so a renewed certificate needs no restart), and a stop
//! that loses no work.
//!
//! A stop ([`serve`]'s `shutdown` resolving — SIGTERM or Ctrl-C in `reliq admin serve`)
//! goes in this order, so that a load balancer and an operator polling a job both see it:
//!
//! 1. `/readyz` answers 503 `draining` and no new replay or purge starts (503); every
//!    other request is still served, job polls included;
//! 2. running jobs get [`ServeOptions::job_grace`] to finish; those still running are
//!    cancelled and stop once their copies in flight are confirmed (their remaining
//!    entries stay in the DLQ: handed back), waited for up to
//!    [`ServeOptions::hand_back`];
//! 3. the listener closes and open requests get [`ServeOptions::request_grace`].
//!
//! A supervisor's stop timeout (systemd's `TimeoutStopSec`, Kubernetes'
//! `terminationGracePeriodSeconds`) should exceed the three together.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use crate::error::AdminError;
use crate::http::{Limits, router};
use crate::jobs::Drained;
use crate::state::AdminState;

/// The server's certificate and key (PEM files), and how often they are checked for a
/// change.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// How often both files are read again; a change (by content) is loaded without
    /// dropping a connection. A file that does not load keeps the old certificate in
    /// service (logged as an error).
    pub reload_every: Duration,
}

/// How [`serve`] serves and stops.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Request limits.
    pub limits: Limits,
    /// Serve HTTPS with these files; plain HTTP when absent (behind a terminating proxy).
    pub tls: Option<TlsFiles>,
    /// How long running jobs may take to finish once the stop begins.
    pub job_grace: Duration,
    /// How long cancelled jobs get to confirm their copies in flight.
    pub hand_back: Duration,
    /// How long open requests get once the listener closes.
    pub request_grace: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            tls: None,
            job_grace: Duration::from_secs(30),
            hand_back: Duration::from_secs(30),
            request_grace: Duration::from_secs(10),
        }
    }
}

/// The certificate and key as loaded, for a change check.
struct LoadedTls {
    config: Arc<rustls::ServerConfig>,
    fingerprint: [u8; 32],
}

/// Read and check the certificate files (a bad file fails naming it).
pub fn load_tls(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, AdminError> {
    read_tls(files).map(|l| l.config)
}

fn read_tls(files: &TlsFiles) -> Result<LoadedTls, AdminError> {
    let read = |what: &'static str, path: &PathBuf| {
        std::fs::read(path).map_err(|source| AdminError::File {
            what,
            path: path.display().to_string(),
            source,
        })
    };
    let cert_pem = read("TLS certificate", &files.cert)?;
    let key_pem = read("TLS key", &files.key)?;
    let invalid = |what: &'static str, path: &PathBuf, why: String| AdminError::File {
        what,
        path: path.display().to_string(),
        source: io::Error::new(io::ErrorKind::InvalidData, why),
    };
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid("TLS certificate", &files.cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(invalid(
            "TLS certificate",
            &files.cert,
            "no CERTIFICATE block in the file".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| invalid("TLS key", &files.key, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("TLS certificate", &files.cert, e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| {
            invalid(
                "TLS key",
                &files.key,
                format!("does not fit the certificate: {e}"),
            )
        })?;
    // The server speaks HTTP/1.1 only (axum's `http1`).
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut digest = Sha256::new();
    digest.update(&cert_pem);
    digest.update(&key_pem);
    Ok(LoadedTls {
        config: Arc::new(config),
        fingerprint: digest.finalize().into(),
    })
}

/// Read the files every `reload_every`; load a changed pair into `live`.
async fn reload_tls(files: TlsFiles, live: RustlsConfig, mut fingerprint: [u8; 32]) {
    let mut every = tokio::time::interval(files.reload_every.max(Duration::from_millis(100)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await;
    loop {
        every.tick().await;
        let files = files.clone();
        let loaded = match tokio::task::spawn_blocking(move || read_tls(&files)).await {
            Ok(loaded) => loaded,
            Err(e) => {
                tracing::error!(error = %e, "reading the TLS files panicked");
                continue;
            }
        };
        match loaded {
            Ok(loaded) if loaded.fingerprint != fingerprint => {
                live.reload_from_config(loaded.config);
                fingerprint = loaded.fingerprint;
                metrics::counter!(TLS_RELOADS, "outcome" => "loaded").increment(1);
                tracing::info!("TLS certificate changed on disk: loaded");
            }
            Ok(_) => {}
            Err(e) => {
                // Mid-rotation a reader can see a new certificate with the old key: keep
                // serving the old pair and try again at the next tick.
                metrics::counter!(TLS_RELOADS, "outcome" => "failed").increment(1);
                tracing::error!(error = %e, "TLS files changed but do not load; still serving the previous certificate");
            }
        }
    }
}

/// Certificate reloads (by outcome: loaded, failed).
pub const TLS_RELOADS: &str = "reliq_admin_tls_reloads_total";

/// Serve the API and the console on `listener` until `shutdown` resolves, then stop as
/// the module docs say; returns what became of the running jobs.
pub async fn serve(
    listener: std::net::TcpListener,
    state: Arc<AdminState>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Drained, AdminError> {
    let name = listener_name(&listener);
    let io_error = |source| AdminError::File {
        what: "listener",
        path: name.clone(),
        source,
    };
    metrics::describe_counter!(
        TLS_RELOADS,
        metrics::Unit::Count,
        "Times the admin server's TLS files changed on disk (by outcome: loaded, failed)."
    );
    listener.set_nonblocking(true).map_err(io_error)?;
    let app =
        router(state.clone(), options.limits).into_make_service_with_connect_info::<SocketAddr>();
    let handle = axum_server::Handle::new();
    let stopping = {
        let handle = handle.clone();
        let state = state.clone();
        let options = options.clone();
        tokio::spawn(async move {
            shutdown.await;
            tracing::info!("stopping: draining jobs, then closing the listener");
            let drained = state
                .jobs()
                .drain(options.job_grace, options.hand_back)
                .await;
            handle.graceful_shutdown(Some(options.request_grace));
            drained
        })
    };
    let served = match &options.tls {
        Some(files) => {
            let loaded = read_tls(files)?;
            let live = RustlsConfig::from_config(loaded.config);
            let reloader =
                tokio::spawn(reload_tls(files.clone(), live.clone(), loaded.fingerprint));
            let served = axum_server::from_tcp_rustls(listener, live)
                .map_err(io_error)?
                .handle(handle)
                .serve(app)
                .await;
            reloader.abort();
            served
        }
        None => {
            axum_server::from_tcp(listener)
                .map_err(io_error)?
                .handle(handle)
                .serve(app)
                .await
        }
    };
    served.map_err(io_error)?;
    stopping.await.map_err(|e| AdminError::File {
        what: "shutdown",
        path: "the admin server's jobs".into(),
        source: io::Error::other(e.to_string()),
    })
}

fn listener_name(listener: &std::net::TcpListener) -> String {
    listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "the admin server's socket".into())
}

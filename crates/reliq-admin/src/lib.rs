//! # reliq-admin
//!
//! The operator's half of reliq: what the person paged at 3 a.m. because a DLQ is filling
//! does with it, on any backend, through the seam's [`DeadLetters`](reliq_core::DeadLetters)
//! reader (which browses without removing anything).
//!
//! - [`Dlq`]: the operations on one consumer's DLQ — [`Dlq::stats`] (counts, oldest age,
//!   groups by reason, class and error [`Fingerprint`](reliq_core::Fingerprint)),
//!   [`Dlq::list`] and [`Dlq::show`] (read, change nothing), [`Dlq::replay`] (dry run,
//!   rate, target), [`Dlq::edit`] (a corrected copy with a new id whose causation id is
//!   the original's) and [`Dlq::purge`]. Replay and purge are the engine's
//!   ([`reliq_core::Replay`]): a dead letter is removed only after its copy is confirmed.
//! - [`FilterSpec`]: which dead letters, as flags, query strings and JSON bodies say it;
//!   the same spec drives every operation, so what `ls` shows is what `replay` moves.
//! - [`http`]: the same operations as an authenticated JSON API ([`http::router`]) —
//!   bearer [`Tokens`] with a [`Role`], replay and purge as [`Jobs`], every request in the
//!   [`AuditLog`] — and as a web console of server-rendered pages under `/console/`
//!   (sign-in with a token, a session cookie, a CSRF token on every form that changes
//!   something, the role checked on every post).
//!
//! - [`TriageStore`]: operators' decisions per failure group (status, assignee, notes) in
//!   a SQLite file beside the audit log; `stats` leaves archived groups out unless asked.
//! - [`Oidc`]: single sign-on for the console (OpenID Connect, authorization code with
//!   PKCE; a roles claim mapped to reader / operator / admin; the session ends when the
//!   provider's token does). The API keeps bearer tokens.
//! - [`serve`]: the API as a service — its own TLS with certificate reload, `/healthz`
//!   and `/readyz`, and a stop that drains running jobs ([`ServeOptions`]).
//!
//! The `reliq` command (crate `reliq-cli`) is clap over [`Dlq`] and [`serve`].

mod audit;
mod auth;
mod console;
mod error;
mod filter;
pub mod http;
mod jobs;
mod oidc;
mod ops;
mod server;
mod sessions;
mod state;
mod throttle;
mod triage;

pub use audit::{AuditLog, AuditRecord};
pub use auth::{Principal, Refusal, Role, Tokens, hash_token, new_token};
pub use error::AdminError;
pub use filter::{FILTER_FIELDS, FilterSpec};
pub use jobs::{Drained, JobContext, JobState, JobView, Jobs};
pub use oidc::{CALLBACK_PATH, Oidc, OidcError, OidcSettings, RoleMap, SIGNED_OUT_PATH};
pub use ops::{
    Dlq, DlqStats, EditOutcome, EditRequest, EntryDetail, EntryList, EntrySummary, FailedEntry,
    Group, MAX_LIST, PurgeRequest, ReplayRequest, Run, RunOutcome, SchemaView,
};
pub use server::{ServeOptions, TLS_RELOADS, TlsFiles, load_tls, serve};
pub use sessions::SESSION_COOKIE;
pub use throttle::{AuthBudget, REFUSED_REQUESTS};
pub use triage::{
    MAX_ASSIGNEE, MAX_NOTE, Triage, TriageChange, TriageNote, TriageStatus, TriageStore,
    check_fingerprint,
};

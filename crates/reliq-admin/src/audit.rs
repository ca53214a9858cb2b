//! The audit log: every request, allowed or refused, and every job's end — who, what,
//! filters, counts, outcome — on the `reliq::audit` tracing target and, when configured,
//! appended as one JSON line to a file. Tokens and payloads never appear in it: a record
//! has no field that could carry them.

use reliq_core::seam::lock;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::Serialize;

use crate::error::AdminError;
use crate::filter::FilterSpec;

/// One audit record.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AuditRecord {
    /// When (RFC 3339).
    pub at: String,
    /// The token entry's name; `None` when the request carried no valid token.
    pub actor: Option<String>,
    /// Its role.
    pub role: Option<&'static str>,
    /// The peer address.
    pub remote: Option<String>,
    /// `GET /v1/…` — method and path, without the query string.
    pub request: String,
    /// The operation (`stats`, `replay`, …; `job-finished` for a job's end).
    pub action: String,
    /// The consumer whose DLQ it concerns.
    pub consumer: Option<String>,
    /// The filter, as given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<FilterSpec>,
    /// `allowed`, `refused`, `failed`, `succeeded`, `cancelled`.
    pub outcome: &'static str,
    /// The HTTP status answered.
    pub status: u16,
    /// Why it was refused or failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Counts (matched, done, failed) of a finished job or a dry run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counts: Option<serde_json::Value>,
    /// The job, for replay and purge.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// What a change changed: a triage change's group, status, assignee and note.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<serde_json::Value>,
}

/// Where audit records go.
#[derive(Debug)]
pub struct AuditLog {
    file: Option<(PathBuf, Mutex<std::fs::File>)>,
}

impl AuditLog {
    /// Records on the `reliq::audit` tracing target only.
    pub fn tracing_only() -> Self {
        Self { file: None }
    }

    /// Records on the tracing target and appended to `path` (created if missing; never
    /// truncated).
    pub fn to_file(path: impl AsRef<Path>) -> Result<Self, AdminError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| AdminError::File {
                what: "audit log",
                path: path.display().to_string(),
                source,
            })?;
        Ok(Self {
            file: Some((path, Mutex::new(file))),
        })
    }

    /// The last `n` records of the audit file, newest first (empty without a file).
    pub fn tail(&self, n: usize) -> Vec<serde_json::Value> {
        let Some((path, _)) = &self.file else {
            return Vec::new();
        };
        let Ok(text) = std::fs::read_to_string(path) else {
            return Vec::new();
        };
        text.lines()
            .rev()
            .take(n)
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// Write one record (its `at` is set here).
    pub fn write(&self, mut record: AuditRecord) {
        record.at = reliq_core::seam::headers::format_time(SystemTime::now());
        let line = match serde_json::to_string(&record) {
            Ok(line) => line,
            Err(e) => {
                tracing::error!(target: "reliq::audit", error = %e, "an audit record could not be written");
                return;
            }
        };
        tracing::info!(target: "reliq::audit", actor = record.actor.as_deref().unwrap_or("-"),
            request = %record.request, action = %record.action, outcome = record.outcome,
            status = record.status, record = %line, "audit");
        if let Some((path, file)) = &self.file {
            let mut file = lock(file);
            // One write per line: appends from concurrent requests never interleave.
            if let Err(e) = file.write_all(format!("{line}\n").as_bytes()) {
                tracing::error!(target: "reliq::audit", path = %path.display(), error = %e,
                    "appending to the audit log failed");
            }
        }
    }
}

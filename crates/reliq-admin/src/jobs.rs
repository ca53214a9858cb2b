//! Replays and purges run as jobs: started by one request, polled for progress by
//! others, cancelled by one more. A job lives in this process (a restarted server forgets
//! it — and loses nothing: a replay interrupted midway is simply run again).

use reliq_core::{Progress, seam::lock};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditLog, AuditRecord};
use crate::error::AdminError;
use crate::filter::FilterSpec;
use crate::ops::RunOutcome;

/// Where a job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    /// Still going.
    Running,
    /// Done, every matching entry went.
    Succeeded,
    /// Done, some entries were left in the DLQ (`outcome.failed`).
    Incomplete,
    /// Stopped by a cancel; `outcome` says what it did.
    Cancelled,
    /// Stopped by an error (`error`); what it did before is not lost, only unreported.
    Failed,
}

/// A job as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobView {
    /// The job id.
    pub id: String,
    /// `replay` or `purge`.
    pub operation: &'static str,
    /// The consumer.
    pub consumer: String,
    /// Who started it.
    pub actor: String,
    /// Where it is.
    pub state: JobState,
    /// How far it is.
    pub progress: Progress,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// When it ended.
    pub finished_at: Option<String>,
    /// What it did, once ended.
    pub outcome: Option<RunOutcome>,
    /// Why it failed.
    pub error: Option<String>,
}

struct Job {
    cancel: CancellationToken,
    view: Mutex<JobView>,
}

/// The jobs of one server.
#[derive(Default)]
pub struct Jobs {
    jobs: Mutex<HashMap<String, Arc<Job>>>,
}

impl std::fmt::Debug for Jobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.jobs.lock().map(|j| j.len()).unwrap_or(0);
        f.debug_struct("Jobs").field("jobs", &n).finish()
    }
}

/// What a job's task is handed: a progress sink and its cancel token.
#[derive(Clone)]
pub struct JobContext {
    job: Arc<Job>,
}

impl std::fmt::Debug for JobContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobContext").finish_non_exhaustive()
    }
}

impl JobContext {
    /// A progress callback for the engine.
    pub fn progress(&self) -> impl Fn(&Progress) + Send + Sync + 'static {
        let job = self.job.clone();
        move |p| lock(&job.view).progress = *p
    }

    /// The job's cancel token.
    pub fn cancel(&self) -> CancellationToken {
        self.job.cancel.clone()
    }
}

impl Jobs {
    /// Start `run` as a job of `operation` on `consumer`'s DLQ for `actor`; its end is
    /// written to `audit`.
    pub fn spawn<F>(
        &self,
        operation: &'static str,
        consumer: &str,
        actor: &str,
        filter: &FilterSpec,
        audit: Arc<AuditLog>,
        run: impl FnOnce(JobContext) -> F,
    ) -> JobView
    where
        F: Future<Output = Result<RunOutcome, AdminError>> + Send + 'static,
    {
        let id = uuid::Uuid::now_v7().to_string();
        let job = Arc::new(Job {
            cancel: CancellationToken::new(),
            view: Mutex::new(JobView {
                id: id.clone(),
                operation,
                consumer: consumer.to_owned(),
                actor: actor.to_owned(),
                state: JobState::Running,
                progress: Progress::default(),
                started_at: reliq_core::seam::headers::format_time(SystemTime::now()),
                finished_at: None,
                outcome: None,
                error: None,
            }),
        });
        let view = lock(&job.view).clone();
        lock(&self.jobs).insert(id.clone(), job.clone());
        let task = run(JobContext { job: job.clone() });
        let filter = filter.clone();
        tokio::spawn(async move {
            let result = task.await;
            let mut view = lock(&job.view);
            view.finished_at = Some(reliq_core::seam::headers::format_time(SystemTime::now()));
            let (outcome, status, reason, counts) = match result {
                Ok(done) => {
                    view.state = if done.cancelled {
                        JobState::Cancelled
                    } else if done.complete() {
                        JobState::Succeeded
                    } else {
                        JobState::Incomplete
                    };
                    let counts = serde_json::json!({
                        "scanned": done.scanned, "matched": done.matched,
                        "done": done.done, "failed": done.failed.len(),
                    });
                    view.outcome = Some(done);
                    let outcome = match view.state {
                        JobState::Cancelled => "cancelled",
                        JobState::Succeeded => "succeeded",
                        _ => "failed",
                    };
                    (outcome, 200, None, Some(counts))
                }
                Err(e) => {
                    view.state = JobState::Failed;
                    view.error = Some(e.to_string());
                    ("failed", e.status(), Some(e.to_string()), None)
                }
            };
            audit.write(AuditRecord {
                actor: Some(view.actor.clone()),
                request: format!("job {}", view.id),
                action: format!("{}-finished", view.operation),
                consumer: Some(view.consumer.clone()),
                filter: Some(filter),
                outcome,
                status,
                reason,
                counts,
                job: Some(view.id.clone()),
                ..AuditRecord::default()
            });
        });
        view
    }

    /// The job `id`.
    pub fn get(&self, id: &str) -> Result<JobView, AdminError> {
        let jobs = lock(&self.jobs);
        let job = jobs
            .get(id)
            .ok_or_else(|| AdminError::NoSuchJob(id.chars().take(80).collect()))?;
        Ok(lock(&job.view).clone())
    }

    /// Every job, newest first.
    pub fn list(&self) -> Vec<JobView> {
        let mut views: Vec<JobView> = lock(&self.jobs)
            .values()
            .map(|j| lock(&j.view).clone())
            .collect();
        // Ids are UUIDv7: later ids sort later.
        views.sort_by(|a, b| b.id.cmp(&a.id));
        views
    }

    /// Ask the job `id` to stop (it ends as `cancelled` once its copies in flight are
    /// confirmed); the job as it is now.
    pub fn cancel(&self, id: &str) -> Result<JobView, AdminError> {
        let jobs = lock(&self.jobs);
        let job = jobs
            .get(id)
            .ok_or_else(|| AdminError::NoSuchJob(id.chars().take(80).collect()))?;
        job.cancel.cancel();
        Ok(lock(&job.view).clone())
    }
}

//! Replays and purges run as jobs: started by one request, polled for progress by
//! others, cancelled by one more. A job lives in this process (a restarted server forgets
//! it — and loses nothing: a replay interrupted midway is simply run again).
//!
//! A server that stops [drains](Jobs::drain) them: no new job starts, running ones get
//! a grace period to finish, and those still running then are cancelled — they stop once
//! their copies in flight are confirmed, leaving the rest of their entries in the DLQ
//! (handed back: a new run on a running server picks them up).

use reliq_core::{Progress, seam::lock};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
    /// Every job's task, for [`Jobs::drain`].
    tasks: TaskTracker,
    /// Set by [`Jobs::drain`]: no new job starts.
    draining: AtomicBool,
}

/// What [`Jobs::drain`] did with the jobs running when the server stopped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Drained {
    /// Jobs that ended within the grace period.
    pub finished: usize,
    /// Jobs cancelled at the end of the grace period that stopped cleanly: their copies
    /// in flight confirmed, what they had not reached still in the DLQ.
    pub handed_back: usize,
    /// Jobs that had not stopped when the server gave up waiting (the broker did not
    /// confirm their last copies): their entries are still in the DLQ, and an entry
    /// whose copy was in flight may be replayed once more by the next run.
    pub abandoned: usize,
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
    /// Refused with [`AdminError::ShuttingDown`] once the server drains.
    pub fn spawn<F>(
        &self,
        operation: &'static str,
        consumer: &str,
        actor: &str,
        filter: &FilterSpec,
        audit: Arc<AuditLog>,
        run: impl FnOnce(JobContext) -> F,
    ) -> Result<JobView, AdminError>
    where
        F: Future<Output = Result<RunOutcome, AdminError>> + Send + 'static,
    {
        if self.is_draining() {
            return Err(AdminError::ShuttingDown);
        }
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
        self.tasks.spawn(async move {
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
        Ok(view)
    }

    /// Whether the server is stopping (no new job starts; `/readyz` answers 503).
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Stop starting jobs, give the running ones `grace` to finish, then cancel the rest
    /// and wait up to `hand_back` for them to stop (each end is audited as usual).
    pub async fn drain(&self, grace: Duration, hand_back: Duration) -> Drained {
        self.draining.store(true, Ordering::Release);
        self.tasks.close();
        let running = |jobs: &Self| {
            lock(&jobs.jobs)
                .values()
                .filter(|j| lock(&j.view).state == JobState::Running)
                .count()
        };
        let at_start = running(self);
        if tokio::time::timeout(grace, self.tasks.wait()).await.is_ok() {
            return Drained {
                finished: at_start,
                ..Drained::default()
            };
        }
        let cancelled = running(self);
        for job in lock(&self.jobs).values() {
            job.cancel.cancel();
        }
        let stopped = tokio::time::timeout(hand_back, self.tasks.wait())
            .await
            .is_ok();
        let abandoned = if stopped { 0 } else { running(self) };
        Drained {
            finished: at_start - cancelled,
            handed_back: cancelled - abandoned,
            abandoned,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_drain_lets_quick_jobs_finish_hands_back_slow_ones_and_refuses_new_ones() {
        let jobs = Jobs::default();
        let audit = Arc::new(AuditLog::tracing_only());
        let filter = FilterSpec::default();
        let spawn =
            |run: std::pin::Pin<
                Box<dyn Future<Output = Result<RunOutcome, AdminError>> + Send>,
            >| jobs.spawn("replay", "billing", "ada", &filter, audit.clone(), |_| run);
        spawn(Box::pin(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok(RunOutcome::default())
        }))
        .expect("quick");
        // Stops when cancelled, like the replay engine once its copies are confirmed.
        let handed = jobs
            .spawn("replay", "billing", "ada", &filter, audit.clone(), |ctx| {
                let cancel = ctx.cancel();
                async move {
                    cancel.cancelled().await;
                    Ok(RunOutcome {
                        cancelled: true,
                        ..RunOutcome::default()
                    })
                }
            })
            .expect("slow");
        // Never stops (a broker that never confirms).
        spawn(Box::pin(std::future::pending())).expect("stuck");

        let drained = jobs
            .drain(Duration::from_millis(300), Duration::from_millis(300))
            .await;
        assert_eq!(
            drained,
            Drained {
                finished: 1,
                handed_back: 1,
                abandoned: 1
            }
        );
        assert_eq!(
            jobs.get(&handed.id).expect("listed").state,
            JobState::Cancelled
        );
        assert!(jobs.is_draining());
        let refused = spawn(Box::pin(async { Ok(RunOutcome::default()) }));
        assert!(
            matches!(refused, Err(AdminError::ShuttingDown)),
            "{refused:?}"
        );
    }
}

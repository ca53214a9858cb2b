//! The operations on one consumer's dead-letter queue. The CLI and the HTTP API are both
//! thin over these, so the two can never disagree.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use reliq_core::{
    Broker, Correction, Cursor, DeadLetter, DeadLetterEntry, DeadLetterFilter, DeadLetters,
    Fingerprint, MessageId, Progress, Replay, ReplayEntry, ReplayTarget, Subscription,
};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::error::AdminError;
use crate::filter::FilterSpec;
use crate::triage::TriageStatus;

/// One consumer's dead-letter queue on one broker.
#[derive(Clone)]
pub struct Dlq {
    broker: Arc<dyn Broker>,
    subscription: Subscription,
    /// Asked during a replay whether to go on (see [`Dlq::with_guard`]).
    guard: Option<(Duration, Arc<dyn reliq_core::ReplayGuard>)>,
    /// Decodes registry-framed payloads for `show` (see [`Dlq::with_schema_registry`]).
    registry: Option<Arc<reliq_contracts::SchemaRegistry>>,
}

impl std::fmt::Debug for Dlq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dlq")
            .field("broker", &self.broker.kind())
            .field("subscription", &self.subscription)
            .finish()
    }
}

/// `stats`: what the DLQ holds, grouped so one bug is one row.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DlqStats {
    /// The consumer.
    pub consumer: String,
    /// Entries matching the filter.
    pub count: u64,
    /// Entries without a readable dead-letter record (never matched by a filter).
    pub unreadable: u64,
    /// The oldest matching entry's dead-lettered-at (RFC 3339).
    pub oldest_dead_lettered_at: Option<String>,
    /// Its age, in whole seconds.
    pub oldest_age_seconds: Option<u64>,
    /// Counts by dead-letter reason.
    pub by_reason: BTreeMap<String, u64>,
    /// Counts by error class (`none` for entries without one).
    pub by_class: BTreeMap<String, u64>,
    /// One row per error fingerprint, most entries first (archived ones left out unless
    /// asked: see [`DlqStats::annotate`]).
    pub groups: Vec<Group>,
    /// Groups left out because operators archived them.
    pub archived_groups: u64,
}

impl DlqStats {
    /// Mark the groups with their triage (fingerprint → status, assignee, as
    /// [`TriageStore::statuses`](crate::TriageStore::statuses) reads it) and, unless
    /// `include_archived`, leave the archived ones out (counted in `archived_groups`).
    pub fn annotate(
        &mut self,
        triage: &std::collections::HashMap<String, (TriageStatus, Option<String>)>,
        include_archived: bool,
    ) {
        for group in &mut self.groups {
            if let Some((status, assignee)) = triage.get(&group.fingerprint.id) {
                group.status = *status;
                group.assignee = assignee.clone();
            }
        }
        if !include_archived {
            let before = self.groups.len();
            self.groups.retain(|g| g.status != TriageStatus::Archived);
            self.archived_groups = (before - self.groups.len()) as u64;
        }
    }
}

/// One error fingerprint's entries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Group {
    /// The fingerprint (id, reason, class, masked error).
    #[serde(flatten)]
    pub fingerprint: Fingerprint,
    /// Entries in the group.
    pub count: u64,
    /// The earliest dead-lettered-at in the group (RFC 3339).
    pub first_seen: String,
    /// The latest.
    pub last_seen: String,
    /// One entry's id, to `show`.
    pub example_id: String,
    /// Its triage status (`new` until an operator sets one).
    pub status: TriageStatus,
    /// Who has it.
    pub assignee: Option<String>,
}

/// One entry as `ls` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EntrySummary {
    /// The message id.
    pub id: String,
    /// Where the DLQ holds it, in the broker's terms.
    pub position: String,
    /// The message key, if any.
    pub key: Option<String>,
    /// Dead-letter reason.
    pub reason: String,
    /// Last error's class.
    pub class: Option<String>,
    /// Last error's text.
    pub error: Option<String>,
    /// Error fingerprint id.
    pub fingerprint: String,
    /// Delivery attempts made.
    pub attempts: u32,
    /// When it was dead-lettered (RFC 3339).
    pub dead_lettered_at: String,
    /// Payload size in bytes.
    pub payload_bytes: usize,
}

/// `ls`: a page of matching entries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EntryList {
    /// The entries, in DLQ order.
    pub entries: Vec<EntrySummary>,
    /// Where the next `ls` starts (pass as `--cursor`).
    pub next_cursor: String,
    /// Nothing matching is left after this page.
    pub at_end: bool,
    /// Entries read to fill the page.
    pub scanned: u64,
}

/// `show`: one entry in full.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EntryDetail {
    /// What `ls` shows.
    #[serde(flatten)]
    pub summary: EntrySummary,
    /// Every header.
    pub headers: BTreeMap<String, String>,
    /// `json` (the payload parsed), `text` (UTF-8) or `hex`.
    pub payload_encoding: &'static str,
    /// The payload: a JSON value, a string, or hex digits.
    pub payload: serde_json::Value,
    /// With a schema registry ([`Dlq::with_schema_registry`]) and a payload in its wire
    /// format: the payload decoded with its writer's schema, or why it was not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schema: Option<SchemaView>,
}

/// A dead letter's payload as its writer's schema reads it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SchemaView {
    /// Decoded (or named, for Protobuf) with the schema its header names.
    Decoded(reliq_contracts::Readable),
    /// The registry could not be asked, or does not have the schema id.
    Unavailable {
        /// What went wrong.
        error: String,
    },
}

/// A replay as the operator asks for it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplayRequest {
    /// Which entries.
    pub filter: FilterSpec,
    /// List what would go, change nothing.
    pub dry_run: bool,
    /// At most this many per second (absent or 0: as fast as the broker confirms).
    pub rate: Option<u32>,
    /// Start at this many per second and raise the rate evenly to `rate` over `ramp`.
    pub rate_start: Option<u32>,
    /// How long the rise from `rate_start` to `rate` takes (`5m`, `30s`).
    pub ramp: Option<String>,
    /// `consumer` (default: only the consumer that dead-lettered them) or `original`
    /// (the original destination: every consumer of it).
    pub target: Option<String>,
}

/// A purge as the operator asks for it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PurgeRequest {
    /// Which entries.
    pub filter: FilterSpec,
    /// List what would go, remove nothing.
    pub dry_run: bool,
}

/// A replay or a purge: the two runs that walk a DLQ through a filter, as jobs, with
/// progress and a cancel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Run {
    /// Replay the matching entries.
    Replay(ReplayRequest),
    /// Purge them.
    Purge(PurgeRequest),
}

impl Run {
    /// `replay` or `purge`.
    pub fn operation(&self) -> &'static str {
        match self {
            Self::Replay(_) => "replay",
            Self::Purge(_) => "purge",
        }
    }

    /// Which entries.
    pub fn filter(&self) -> &FilterSpec {
        match self {
            Self::Replay(r) => &r.filter,
            Self::Purge(p) => &p.filter,
        }
    }

    /// Only list what would go.
    pub fn dry_run(&self) -> bool {
        match self {
            Self::Replay(r) => r.dry_run,
            Self::Purge(p) => p.dry_run,
        }
    }
}

/// What a replay or purge did (or, in a dry run, would do).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RunOutcome {
    /// `replay` or `purge`.
    pub operation: &'static str,
    /// Nothing was changed.
    pub dry_run: bool,
    /// Entries read.
    pub scanned: u64,
    /// Entries matching the filter (in a dry run: would go).
    pub matched: u64,
    /// Replayed and removed, or purged.
    pub done: u64,
    /// Left in the DLQ, with why.
    pub failed: Vec<FailedEntry>,
    /// Entries without a readable dead-letter record (left alone).
    pub unreadable: u64,
    /// Stopped before the end (cancelled); what it did is above.
    pub cancelled: bool,
    /// Why a replay's guard stopped it (then `cancelled` too): the rest is in the DLQ.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// Wall time of the run, seconds (reads, publishing, removals).
    pub elapsed_seconds: f64,
    /// A replay's publishing time: first copy sent to last confirmed, seconds (what
    /// `--rate` paces); a purge's wall time.
    pub publishing_seconds: f64,
    /// `done` per second of `publishing_seconds`: the rate achieved against `--rate`.
    pub rate_per_second: f64,
    /// Matching entries by fingerprint id.
    pub by_fingerprint: BTreeMap<String, u64>,
    /// The ids matched (dry run) or done.
    pub ids: Vec<String>,
}

impl RunOutcome {
    /// Every matching entry went (none failed, the run was not cancelled or stopped).
    pub fn complete(&self) -> bool {
        self.failed.is_empty() && !self.cancelled && self.stopped.is_none()
    }

    fn stopped_by(mut self, why: Option<String>) -> Self {
        self.stopped = why;
        self
    }
}

/// An entry a run left in the DLQ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailedEntry {
    /// The message id.
    pub id: String,
    /// Why.
    pub error: String,
}

/// An edit-and-replay as the operator asks for it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EditRequest {
    /// The corrected payload (`None`: keep the dead letter's).
    pub payload: Option<Bytes>,
    /// Instead of `payload`: the corrected value as JSON, written with the schema the
    /// dead letter's registry-framed payload names (same schema id; Avro and JSON
    /// Schema). Needs [`Dlq::with_schema_registry`].
    pub value: Option<serde_json::Value>,
    /// Headers to set on the copy, `name=value`.
    pub headers: Vec<String>,
}

/// What an edit did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EditOutcome {
    /// The dead letter's id (removed from the DLQ).
    pub original: String,
    /// The corrected copy's id (its causation id is `original`).
    pub copy: String,
}

impl Dlq {
    /// The DLQ of `subscription`'s consumer on `broker`. Its consumer and source names
    /// are checked here, before they reach the broker
    /// ([`Subscription::check_names`]): a refused one is [`AdminError::InvalidInput`]
    /// naming `consumer` or `source`. Nothing is opened yet; an operation on a consumer
    /// that never subscribed fails with [`BrokerError::NotFound`](reliq_core::BrokerError::NotFound)
    /// and creates nothing.
    pub fn new(broker: Arc<dyn Broker>, subscription: Subscription) -> Result<Self, AdminError> {
        subscription.check_names()?;
        Ok(Self {
            broker,
            subscription,
            guard: None,
            registry: None,
        })
    }

    /// `show` decodes a payload in the schema-registry wire format with the writer's
    /// schema it names, from `registry` (Avro, JSON Schema and Protobuf bodies to JSON),
    /// and `edit` may take the corrected value as JSON. The bytes are shown as they are
    /// besides.
    pub fn with_schema_registry(mut self, registry: Arc<reliq_contracts::SchemaRegistry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Replays ask `guard` every `every` whether to go on, and stop (the outcome's
    /// `stopped`, incomplete) when it says no — e.g. when the consumer they feed starts
    /// failing again.
    pub fn with_guard(mut self, every: Duration, guard: Arc<dyn reliq_core::ReplayGuard>) -> Self {
        self.guard = Some((every, guard));
        self
    }

    /// The consumer.
    pub fn consumer(&self) -> &str {
        &self.subscription.consumer
    }

    async fn reader(&self) -> Result<Box<dyn DeadLetters>, AdminError> {
        Ok(self.broker.dead_letters(&self.subscription).await?)
    }

    /// How many entries the DLQ holds and the oldest one's dead-lettered-at (what the
    /// backend knows cheaply; no filter).
    pub async fn count(&self) -> Result<reliq_core::DeadLetterCount, AdminError> {
        Ok(self.reader().await?.count().await?)
    }

    /// Counts, oldest age, and groups by reason, class and error fingerprint of the
    /// entries matching `spec` (the limit is ignored: stats read the whole DLQ). Reads;
    /// changes nothing.
    pub async fn stats(&self, spec: &FilterSpec) -> Result<DlqStats, AdminError> {
        let now = SystemTime::now();
        let filter = FilterSpec {
            limit: None,
            ..spec.clone()
        }
        .to_filter(now)?;
        let dlq = self.reader().await?;
        let mut stats = DlqStats {
            consumer: self.consumer().to_owned(),
            ..DlqStats::default()
        };
        let mut oldest: Option<SystemTime> = None;
        let mut groups: BTreeMap<String, (Fingerprint, u64, SystemTime, SystemTime, String)> =
            BTreeMap::new();
        let mut cursor = Cursor::start();
        loop {
            let page = dlq.browse(&cursor, PAGE).await?;
            for entry in &page.entries {
                let Ok(record) = entry.record() else {
                    stats.unreadable += 1;
                    continue;
                };
                if !filter.matches(entry, &record) {
                    continue;
                }
                stats.count += 1;
                let at = record.dead_lettered_at;
                oldest = Some(oldest.map_or(at, |o| o.min(at)));
                *stats
                    .by_reason
                    .entry(record.reason.as_str().into())
                    .or_default() += 1;
                let class = record.error_class.map_or("none", |c| c.as_str());
                *stats.by_class.entry(class.into()).or_default() += 1;
                let fingerprint = Fingerprint::of(&record);
                let group = groups
                    .entry(fingerprint.id.clone())
                    .or_insert_with(|| (fingerprint, 0, at, at, entry.id().as_str().to_owned()));
                group.1 += 1;
                group.2 = group.2.min(at);
                group.3 = group.3.max(at);
            }
            if page.at_end || page.entries.is_empty() {
                break;
            }
            cursor = page.next;
        }
        stats.oldest_dead_lettered_at = oldest.map(format_time);
        stats.oldest_age_seconds =
            oldest.map(|o| now.duration_since(o).unwrap_or_default().as_secs());
        let mut rows: Vec<Group> = groups
            .into_values()
            .map(|(fingerprint, count, first, last, example)| Group {
                fingerprint,
                count,
                first_seen: format_time(first),
                last_seen: format_time(last),
                example_id: example,
                status: TriageStatus::New,
                assignee: None,
            })
            .collect();
        rows.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then(a.fingerprint.id.cmp(&b.fingerprint.id))
        });
        stats.groups = rows;
        Ok(stats)
    }

    /// Up to `max` entries (and at most the filter's limit) matching `spec` from `cursor`
    /// on, and the cursor right after the last one listed. Reads; changes nothing.
    pub async fn list(
        &self,
        spec: &FilterSpec,
        cursor: &Cursor,
        max: usize,
    ) -> Result<EntryList, AdminError> {
        let filter = spec.to_filter(SystemTime::now())?;
        // The filter's limit caps this page (a cursor goes on from there).
        let max = max.min(spec.limit.unwrap_or(usize::MAX)).clamp(1, MAX_LIST);
        let dlq = self.reader().await?;
        let mut entries = Vec::new();
        let mut cursor = cursor.clone();
        let mut scanned = 0u64;
        loop {
            let want = max - entries.len();
            let page = dlq.browse(&cursor, PAGE).await?;
            let matching: Vec<usize> = page
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.record().is_ok_and(|r| filter.matches(e, &r)))
                .map(|(i, _)| i)
                .collect();
            if matching.len() > want {
                // More matches than room: read again just up to the last one listed, so
                // the cursor lands right after it and the next `ls` misses nothing.
                let upto = matching[want - 1] + 1;
                let exact = dlq.browse(&cursor, upto).await?;
                scanned += exact.entries.len() as u64;
                entries.extend(exact.entries.iter().filter_map(|e| {
                    e.record()
                        .ok()
                        .filter(|r| filter.matches(e, r))
                        .map(|r| summary(e, &r))
                }));
                return Ok(EntryList {
                    entries,
                    next_cursor: exact.next.to_string(),
                    at_end: false,
                    scanned,
                });
            }
            scanned += page.entries.len() as u64;
            for i in matching {
                let entry = &page.entries[i];
                if let Ok(record) = entry.record() {
                    entries.push(summary(entry, &record));
                }
            }
            let end = page.at_end || page.entries.is_empty();
            cursor = page.next;
            if end || entries.len() >= max || scanned >= MAX_LIST_SCAN {
                return Ok(EntryList {
                    entries,
                    next_cursor: cursor.to_string(),
                    at_end: end,
                    scanned,
                });
            }
        }
    }

    /// The entry `id` in full. Reads; changes nothing.
    pub async fn show(&self, id: &str) -> Result<EntryDetail, AdminError> {
        let dlq = self.reader().await?;
        let entry = dlq
            .get(&MessageId::from(id))
            .await?
            .ok_or_else(|| self.not_found(id))?;
        let mut shown = detail(&entry);
        if let Some(registry) = &self.registry {
            // A registry that does not answer leaves the entry shown as bytes, saying so;
            // A payload not in the wire format is shown as before, without the field.
            shown.schema = match reliq_contracts::readable(registry, entry.payload()).await {
                Ok(Some(readable)) => Some(SchemaView::Decoded(readable)),
                Ok(None) => None,
                Err(e) => Some(SchemaView::Unavailable {
                    error: e.to_string(),
                }),
            };
        }
        Ok(shown)
    }

    /// Replay or purge, as `run` says.
    pub async fn run(
        &self,
        run: &Run,
        progress: impl Fn(&Progress) + Send + Sync + 'static,
        cancel: CancellationToken,
    ) -> Result<RunOutcome, AdminError> {
        match run {
            Run::Replay(r) => self.replay(r, progress, cancel).await,
            Run::Purge(p) => self.purge(p, progress, cancel).await,
        }
    }

    /// Replay the entries matching the request (or, dry, list them). `progress` is called
    /// after every page; `cancel` stops the run after the copies in flight.
    pub async fn replay(
        &self,
        request: &ReplayRequest,
        progress: impl Fn(&Progress) + Send + Sync + 'static,
        cancel: CancellationToken,
    ) -> Result<RunOutcome, AdminError> {
        let filter = request.filter.to_filter(SystemTime::now())?;
        let target = match request.target.as_deref() {
            None | Some("consumer") => ReplayTarget::Consumer,
            Some("original") => ReplayTarget::OriginalDestination,
            Some(other) => {
                return Err(AdminError::InvalidInput {
                    field: "target",
                    value: other.chars().take(80).collect(),
                    expected: "consumer or original".into(),
                });
            }
        };
        let ramp = match (request.rate_start, request.ramp.as_deref(), request.rate) {
            (None, None, _) => None,
            (Some(start), Some(over), Some(rate)) if start > 0 && start <= rate => {
                let over =
                    humantime::parse_duration(over).map_err(|e| AdminError::InvalidInput {
                        field: "ramp",
                        value: over.chars().take(80).collect(),
                        expected: format!("a duration like 5m or 30s: {e}"),
                    })?;
                Some((start, over))
            }
            _ => {
                return Err(AdminError::InvalidInput {
                    field: "rate_start",
                    value: request
                        .rate_start
                        .map(|r| r.to_string())
                        .unwrap_or_default(),
                    expected: "a ramp takes `rate_start` (1 to `rate`), `rate` and `ramp` together"
                        .into(),
                });
            }
        };
        let started = Instant::now();
        let mut replay = self
            .engine(filter)
            .rate_limit(request.rate.unwrap_or(0))
            .target(target)
            .on_progress(progress)
            .cancel_on(cancel);
        if let Some((start, over)) = ramp {
            replay = replay.ramp(start, over);
        }
        if let Some((every, guard)) = &self.guard {
            replay = replay.guard(*every, guard.clone());
        }
        let report = if request.dry_run {
            replay.dry_run().await?
        } else {
            replay.execute().await?
        };
        let ids = listed_ids(request.dry_run, &report.matched, &report.replayed);
        let failed: Vec<FailedEntry> = report
            .failed
            .iter()
            .map(|(id, e)| FailedEntry {
                id: id.as_str().to_owned(),
                error: e.clone(),
            })
            .collect();
        // Replayed but not removed counts as failed, not done: it is still in the DLQ.
        let left: std::collections::HashSet<&MessageId> =
            report.failed.iter().map(|(id, _)| id).collect();
        let done = report
            .replayed
            .iter()
            .filter(|id| !left.contains(id))
            .count();
        Ok(outcome(
            "replay",
            request.dry_run,
            report.scanned,
            &report.matched,
            done,
            failed,
            report.unreadable,
            report.cancelled,
            ids,
            started.elapsed(),
            report.publishing,
        )
        .stopped_by(report.stopped))
    }

    /// Remove the entries matching the request for good (or, dry, list them).
    pub async fn purge(
        &self,
        request: &PurgeRequest,
        progress: impl Fn(&Progress) + Send + Sync + 'static,
        cancel: CancellationToken,
    ) -> Result<RunOutcome, AdminError> {
        let filter = request.filter.to_filter(SystemTime::now())?;
        let started = Instant::now();
        let report = self
            .engine(filter)
            .on_progress(progress)
            .cancel_on(cancel)
            .purge(request.dry_run)
            .await?;
        let ids = listed_ids(request.dry_run, &report.matched, &report.removed);
        Ok(outcome(
            "purge",
            request.dry_run,
            report.scanned,
            &report.matched,
            if request.dry_run {
                0
            } else {
                report.removed.len()
            },
            Vec::new(),
            report.unreadable,
            report.cancelled,
            ids,
            started.elapsed(),
            started.elapsed(),
        ))
    }

    /// Replay a corrected copy of the entry `id` (a new id whose causation id is `id`);
    /// the entry is removed only after the copy is confirmed.
    pub async fn edit(&self, id: &str, request: &EditRequest) -> Result<EditOutcome, AdminError> {
        let mut headers = Vec::new();
        for pair in &request.headers {
            let (name, value) = pair
                .split_once('=')
                .filter(|(n, _)| !n.is_empty())
                .ok_or_else(|| AdminError::InvalidInput {
                    field: "header",
                    value: pair.chars().take(80).collect(),
                    expected: "name=value".into(),
                })?;
            if name.starts_with(reliq_core::seam::headers::PREFIX) {
                return Err(AdminError::InvalidInput {
                    field: "header",
                    value: name.chars().take(80).collect(),
                    expected: "a header outside reliq's own `reliq-` names".into(),
                });
            }
            headers.push((name.to_owned(), value.to_owned()));
        }
        let payload = match (&request.payload, &request.value) {
            (Some(_), Some(_)) => {
                return Err(AdminError::InvalidInput {
                    field: "value",
                    value: String::new(),
                    expected: "either a payload or a value to re-encode, not both".into(),
                });
            }
            (_, Some(value)) => Some(self.reencoded(id, value).await?),
            (payload, None) => payload.clone(),
        };
        let correction = Correction { payload, headers };
        let corrected = self
            .engine(DeadLetterFilter::default())
            .correct(&MessageId::from(id), correction)
            .await?
            .ok_or_else(|| self.not_found(id))?;
        Ok(EditOutcome {
            original: corrected.original.as_str().to_owned(),
            copy: corrected.copy.as_str().to_owned(),
        })
    }

    /// `value` written with the schema the dead letter `id`'s payload names.
    async fn reencoded(&self, id: &str, value: &serde_json::Value) -> Result<Bytes, AdminError> {
        let registry = self
            .registry
            .as_ref()
            .ok_or_else(|| AdminError::InvalidInput {
                field: "value",
                value: String::new(),
                expected: "a schema registry to re-encode with (`--schema-registry URL`); \
                           or send the corrected payload itself"
                    .into(),
            })?;
        let entry = self
            .reader()
            .await?
            .get(&MessageId::from(id))
            .await?
            .ok_or_else(|| self.not_found(id))?;
        let bytes = reliq_contracts::reencoded(registry, entry.payload(), value).await?;
        Ok(Bytes::from(bytes))
    }

    fn engine(&self, filter: DeadLetterFilter) -> Replay {
        Replay::new(self.broker.clone(), self.subscription.clone()).filter(filter)
    }

    fn not_found(&self, id: &str) -> AdminError {
        AdminError::NotFound {
            consumer: self.consumer().to_owned(),
            id: id.chars().take(200).collect(),
        }
    }
}

/// The ids an outcome lists: what matched in a dry run, what was done otherwise.
fn listed_ids(dry_run: bool, matched: &[ReplayEntry], done: &[MessageId]) -> Vec<String> {
    if dry_run {
        matched.iter().map(|e| e.id.as_str().to_owned()).collect()
    } else {
        done.iter().map(|id| id.as_str().to_owned()).collect()
    }
}

#[allow(clippy::too_many_arguments)]
fn outcome(
    operation: &'static str,
    dry_run: bool,
    scanned: usize,
    matched: &[ReplayEntry],
    done: usize,
    failed: Vec<FailedEntry>,
    unreadable: usize,
    cancelled: bool,
    ids: Vec<String>,
    elapsed: Duration,
    publishing: Duration,
) -> RunOutcome {
    let mut by_fingerprint = BTreeMap::new();
    for entry in matched {
        *by_fingerprint
            .entry(Fingerprint::of(&entry.record).id)
            .or_default() += 1;
    }
    let publishing_seconds = publishing.as_secs_f64();
    RunOutcome {
        operation,
        dry_run,
        scanned: scanned as u64,
        matched: matched.len() as u64,
        done: done as u64,
        failed,
        unreadable: unreadable as u64,
        cancelled,
        stopped: None,
        elapsed_seconds: elapsed.as_secs_f64(),
        publishing_seconds,
        rate_per_second: if publishing_seconds > 0.0 {
            done as f64 / publishing_seconds
        } else {
            0.0
        },
        by_fingerprint,
        ids,
    }
}

fn summary(entry: &DeadLetterEntry, record: &DeadLetter) -> EntrySummary {
    EntrySummary {
        id: entry.id().as_str().to_owned(),
        position: entry.position.clone(),
        key: entry.message.key().map(str::to_owned),
        reason: record.reason.as_str().to_owned(),
        class: record.error_class.map(|c| c.as_str().to_owned()),
        error: record.error.clone(),
        fingerprint: Fingerprint::of(record).id,
        attempts: record.attempts,
        dead_lettered_at: format_time(record.dead_lettered_at),
        payload_bytes: entry.payload().len(),
    }
}

fn detail(entry: &DeadLetterEntry) -> EntryDetail {
    let summary = match entry.record() {
        Ok(record) => summary(entry, &record),
        // A foreign message in the DLQ: shown, with what is known.
        Err(e) => EntrySummary {
            id: entry.id().as_str().to_owned(),
            position: entry.position.clone(),
            key: entry.message.key().map(str::to_owned),
            reason: "unknown".into(),
            class: None,
            error: Some(format!("no readable dead-letter record: {e}")),
            fingerprint: String::new(),
            attempts: 0,
            dead_lettered_at: String::new(),
            payload_bytes: entry.payload().len(),
        },
    };
    let headers = entry
        .headers()
        .iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let (payload_encoding, payload) =
        match serde_json::from_slice::<serde_json::Value>(entry.payload()) {
            Ok(value) => ("json", value),
            Err(_) => match std::str::from_utf8(entry.payload()) {
                Ok(text) => ("text", serde_json::Value::String(text.to_owned())),
                Err(_) => (
                    "hex",
                    serde_json::Value::String(hex::encode(entry.payload())),
                ),
            },
        };
    EntryDetail {
        summary,
        headers,
        payload_encoding,
        payload,
        schema: None,
    }
}

fn format_time(t: SystemTime) -> String {
    reliq_core::seam::headers::format_time(t)
}

/// Entries read per browse.
const PAGE: usize = 256;
/// Most entries one `ls` returns.
pub const MAX_LIST: usize = 1_000;
/// Most entries one `ls` reads looking for matches (it then returns what it found and a
/// cursor to go on from).
const MAX_LIST_SCAN: u64 = 20_000;

//! Triage: what operators decided about a failure group (one error fingerprint of one
//! consumer's DLQ) — its status, who has it, and their notes — kept in a small SQLite
//! file beside the audit log, so it outlives the server and is shared by the API, the
//! console and the `reliq dlq triage` command.
//!
//! A group nobody triaged is `new`. `archived` is the operators' "we keep these and
//! stop looking": `stats` and the console leave archived groups out unless asked. Every
//! change is also an audit record (the API's and console's request records carry it in
//! `detail`), so the history is the audit log; the notes are kept here too, in order.
//!
//! The store holds no dead letter: a group that empties keeps its triage (the same bug
//! coming back comes back to its notes).

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Row, SqlitePool};

use crate::error::AdminError;

/// The longest assignee name and note the store takes.
pub const MAX_ASSIGNEE: usize = 100;
/// The longest note, in characters.
pub const MAX_NOTE: usize = 4_000;

/// Where a failure group stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum TriageStatus {
    /// Nobody has looked yet.
    #[default]
    New,
    /// Someone is on it.
    Investigating,
    /// Fixed (its dead letters are typically replayed next).
    Resolved,
    /// Kept, and hidden from the overview and `stats` unless asked.
    Archived,
}

impl TriageStatus {
    /// Every status, in workflow order.
    pub const ALL: [Self; 4] = [
        Self::New,
        Self::Investigating,
        Self::Resolved,
        Self::Archived,
    ];

    /// Its name (`new`, `investigating`, `resolved`, `archived`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Investigating => "investigating",
            Self::Resolved => "resolved",
            Self::Archived => "archived",
        }
    }
}

impl FromStr for TriageStatus {
    type Err = AdminError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| AdminError::InvalidInput {
                field: "status",
                value: s.chars().take(80).collect(),
                expected: "new, investigating, resolved or archived".into(),
            })
    }
}

/// A body's `status`: refused naming the field and the statuses there are.
impl TryFrom<String> for TriageStatus {
    type Error = AdminError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// One note on a group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TriageNote {
    /// When (RFC 3339).
    pub at: String,
    /// Who wrote it (the token's or the signed-in user's name).
    pub author: String,
    /// The note.
    pub text: String,
}

/// A group's triage.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Triage {
    /// The consumer.
    pub consumer: String,
    /// The error fingerprint's id.
    pub fingerprint: String,
    /// Where it stands.
    pub status: TriageStatus,
    /// Who has it.
    pub assignee: Option<String>,
    /// The last change: when (RFC 3339) and by whom; `None` for a group never triaged.
    pub updated_at: Option<String>,
    /// Who made the last change.
    pub updated_by: Option<String>,
    /// Its notes, oldest first.
    pub notes: Vec<TriageNote>,
}

/// A change to a group's triage: each field given is applied.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriageChange {
    /// The new status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<TriageStatus>,
    /// The new assignee; an empty string unassigns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignee: Option<String>,
    /// A note to add.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl TriageChange {
    /// The change as its audit record's `detail`: the group and the fields set.
    pub fn audit_detail(&self, fingerprint: &str) -> serde_json::Value {
        let mut detail = serde_json::to_value(self).unwrap_or_default();
        if let Some(map) = detail.as_object_mut() {
            map.insert(
                "fingerprint".into(),
                fingerprint.chars().take(80).collect::<String>().into(),
            );
        }
        detail
    }

    /// The change, checked: at least one field, an assignee and a note of bounded
    /// length, no control characters in the assignee.
    pub fn checked(self) -> Result<Self, AdminError> {
        let invalid = |field, value: &str, expected: &str| AdminError::InvalidInput {
            field,
            value: value.chars().take(80).collect(),
            expected: expected.into(),
        };
        if self.status.is_none() && self.assignee.is_none() && self.note.is_none() {
            return Err(invalid(
                "triage",
                "",
                "at least one of `status`, `assignee`, `note`",
            ));
        }
        if let Some(a) = &self.assignee
            && (a.chars().count() > MAX_ASSIGNEE || a.chars().any(char::is_control))
        {
            return Err(invalid(
                "assignee",
                a,
                &format!("at most {MAX_ASSIGNEE} characters, no control characters"),
            ));
        }
        if let Some(n) = &self.note
            && (n.trim().is_empty() || n.chars().count() > MAX_NOTE)
        {
            return Err(invalid("note", n, &format!("1 to {MAX_NOTE} characters")));
        }
        Ok(self)
    }
}

/// A fingerprint id as `stats` prints it: 16 hex digits (checked before it reaches the
/// store or a log).
pub fn check_fingerprint(id: &str) -> Result<(), AdminError> {
    if id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(AdminError::InvalidInput {
            field: "fingerprint",
            value: id.chars().take(80).collect(),
            expected: "16 hex digits, as `stats` prints the group's id".into(),
        })
    }
}

/// The triage store (see the module docs).
#[derive(Clone, Debug)]
pub struct TriageStore {
    pool: SqlitePool,
}

const SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS triage_groups (
        consumer    TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        status      TEXT NOT NULL,
        assignee    TEXT,
        updated_at  TEXT NOT NULL,
        updated_by  TEXT NOT NULL,
        PRIMARY KEY (consumer, fingerprint)
    )",
    "CREATE TABLE IF NOT EXISTS triage_notes (
        seq         INTEGER PRIMARY KEY AUTOINCREMENT,
        consumer    TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        at          TEXT NOT NULL,
        author      TEXT NOT NULL,
        text        TEXT NOT NULL
    )",
    "CREATE INDEX IF NOT EXISTS triage_notes_group ON triage_notes (consumer, fingerprint, seq)",
];

fn store_error(what: &'static str) -> impl Fn(sqlx::Error) -> AdminError {
    move |source| AdminError::Store { what, source }
}

impl TriageStore {
    /// The store in the SQLite file at `path`, created (with its tables) if missing.
    /// WAL journal: the server and a `reliq dlq triage` command may share the file.
    pub async fn open(path: &Path) -> Result<Self, AdminError> {
        Self::connect(path, true).await
    }

    /// The store at `path`, which must exist: for a read (`stats`), which creates nothing
    /// — a mistyped path is an error naming it, not a new empty store.
    pub async fn open_existing(path: &Path) -> Result<Self, AdminError> {
        if !path.is_file() {
            return Err(AdminError::InvalidInput {
                field: "triage-db",
                value: path.display().to_string().chars().take(80).collect(),
                expected: "an existing triage store (the admin server's --triage-db file)".into(),
            });
        }
        Self::connect(path, false).await
    }

    async fn connect(path: &Path, create: bool) -> Result<Self, AdminError> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(create)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(std::time::Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(store_error("opening the triage store"))?;
        for statement in SCHEMA {
            sqlx::query(statement)
                .execute(&pool)
                .await
                .map_err(store_error("creating the triage tables"))?;
        }
        Ok(Self { pool })
    }

    /// `consumer`'s triaged groups: fingerprint → (status, assignee). A group not in it
    /// is `new` and unassigned.
    pub async fn statuses(
        &self,
        consumer: &str,
    ) -> Result<HashMap<String, (TriageStatus, Option<String>)>, AdminError> {
        let rows = sqlx::query(
            "SELECT fingerprint, status, assignee FROM triage_groups WHERE consumer = ?",
        )
        .bind(consumer)
        .fetch_all(&self.pool)
        .await
        .map_err(store_error("reading triage"))?;
        rows.into_iter()
            .map(|row| {
                let status: String = row.get("status");
                Ok((
                    row.get::<String, _>("fingerprint"),
                    (status.parse()?, row.get::<Option<String>, _>("assignee")),
                ))
            })
            .collect()
    }

    /// One group's triage, with its notes.
    pub async fn get(&self, consumer: &str, fingerprint: &str) -> Result<Triage, AdminError> {
        check_fingerprint(fingerprint)?;
        let mut triage = Triage {
            consumer: consumer.to_owned(),
            fingerprint: fingerprint.to_owned(),
            ..Triage::default()
        };
        let row = sqlx::query(
            "SELECT status, assignee, updated_at, updated_by FROM triage_groups
             WHERE consumer = ? AND fingerprint = ?",
        )
        .bind(consumer)
        .bind(fingerprint)
        .fetch_optional(&self.pool)
        .await
        .map_err(store_error("reading triage"))?;
        if let Some(row) = row {
            triage.status = row.get::<String, _>("status").parse()?;
            triage.assignee = row.get("assignee");
            triage.updated_at = Some(row.get("updated_at"));
            triage.updated_by = Some(row.get("updated_by"));
        }
        triage.notes = sqlx::query(
            "SELECT at, author, text FROM triage_notes
             WHERE consumer = ? AND fingerprint = ? ORDER BY seq",
        )
        .bind(consumer)
        .bind(fingerprint)
        .fetch_all(&self.pool)
        .await
        .map_err(store_error("reading triage notes"))?
        .into_iter()
        .map(|row| TriageNote {
            at: row.get("at"),
            author: row.get("author"),
            text: row.get("text"),
        })
        .collect();
        Ok(triage)
    }

    /// Apply `change` to a group's triage as `actor`, in one transaction; the triage
    /// after it.
    pub async fn change(
        &self,
        consumer: &str,
        fingerprint: &str,
        actor: &str,
        change: &TriageChange,
    ) -> Result<Triage, AdminError> {
        check_fingerprint(fingerprint)?;
        let change = change.clone().checked()?;
        let now = reliq_core::seam::headers::format_time(SystemTime::now());
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(store_error("changing triage"))?;
        let current = sqlx::query(
            "SELECT status, assignee FROM triage_groups WHERE consumer = ? AND fingerprint = ?",
        )
        .bind(consumer)
        .bind(fingerprint)
        .fetch_optional(&mut *tx)
        .await
        .map_err(store_error("changing triage"))?;
        let (status, assignee) = match current {
            Some(row) => (
                row.get::<String, _>("status").parse()?,
                row.get::<Option<String>, _>("assignee"),
            ),
            None => (TriageStatus::New, None),
        };
        let status = change.status.unwrap_or(status);
        let assignee = match &change.assignee {
            Some(a) if a.trim().is_empty() => None,
            Some(a) => Some(a.trim().to_owned()),
            None => assignee,
        };
        sqlx::query(
            "INSERT INTO triage_groups (consumer, fingerprint, status, assignee, updated_at, updated_by)
             VALUES (?, ?, ?, ?, ?, ?)
             ON CONFLICT (consumer, fingerprint) DO UPDATE SET
                status = excluded.status, assignee = excluded.assignee,
                updated_at = excluded.updated_at, updated_by = excluded.updated_by",
        )
        .bind(consumer)
        .bind(fingerprint)
        .bind(status.as_str())
        .bind(&assignee)
        .bind(&now)
        .bind(actor)
        .execute(&mut *tx)
        .await
        .map_err(store_error("changing triage"))?;
        if let Some(note) = &change.note {
            sqlx::query(
                "INSERT INTO triage_notes (consumer, fingerprint, at, author, text)
                 VALUES (?, ?, ?, ?, ?)",
            )
            .bind(consumer)
            .bind(fingerprint)
            .bind(&now)
            .bind(actor)
            .bind(note.trim())
            .execute(&mut *tx)
            .await
            .map_err(store_error("adding a triage note"))?;
        }
        tx.commit().await.map_err(store_error("changing triage"))?;
        self.get(consumer, fingerprint).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FP: &str = "00aa11bb22cc33dd";

    #[tokio::test]
    async fn a_change_is_kept_with_its_notes_and_outlives_the_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("triage.sqlite");
        let store = TriageStore::open(&path).await.expect("open");
        let fresh = store.get("billing", FP).await.expect("get");
        assert_eq!(fresh.status, TriageStatus::New);
        assert!(fresh.updated_at.is_none() && fresh.notes.is_empty());

        let change = TriageChange {
            status: Some(TriageStatus::Investigating),
            assignee: Some(" alice ".into()),
            note: Some("the schema change of 12:03 drops `sku`".into()),
        };
        let t = store
            .change("billing", FP, "oscar", &change)
            .await
            .expect("change");
        assert_eq!(
            (t.status, t.assignee.as_deref(), t.updated_by.as_deref()),
            (TriageStatus::Investigating, Some("alice"), Some("oscar"))
        );
        let note = TriageChange {
            note: Some("fixed in 4.2.1".into()),
            ..TriageChange::default()
        };
        store
            .change("billing", FP, "alice", &note)
            .await
            .expect("note");
        drop(store);

        let again = TriageStore::open(&path).await.expect("reopen");
        let t = again.get("billing", FP).await.expect("get");
        assert_eq!(
            t.status,
            TriageStatus::Investigating,
            "a note alone keeps the status"
        );
        assert_eq!(t.assignee.as_deref(), Some("alice"));
        let notes: Vec<(&str, &str)> = t
            .notes
            .iter()
            .map(|n| (n.author.as_str(), n.text.as_str()))
            .collect();
        assert_eq!(
            notes,
            [
                ("oscar", "the schema change of 12:03 drops `sku`"),
                ("alice", "fixed in 4.2.1")
            ]
        );
        let unassign = TriageChange {
            assignee: Some(String::new()),
            status: Some(TriageStatus::Archived),
            ..TriageChange::default()
        };
        let t = again
            .change("billing", FP, "ada", &unassign)
            .await
            .expect("archive");
        assert_eq!((t.status, t.assignee), (TriageStatus::Archived, None));
        let all = again.statuses("billing").await.expect("statuses");
        assert_eq!(all.get(FP), Some(&(TriageStatus::Archived, None)));
        assert!(again.statuses("other").await.expect("statuses").is_empty());
    }

    #[tokio::test]
    async fn bad_changes_are_refused_naming_the_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = TriageStore::open(&dir.path().join("t.sqlite"))
            .await
            .expect("open");
        let field = |e: AdminError| match e {
            AdminError::InvalidInput { field, .. } => field,
            other => panic!("{other:?}"),
        };
        let cases = [
            (FP, TriageChange::default(), "triage"),
            (
                FP,
                TriageChange {
                    assignee: Some("a".repeat(MAX_ASSIGNEE + 1)),
                    ..TriageChange::default()
                },
                "assignee",
            ),
            (
                FP,
                TriageChange {
                    note: Some("  ".into()),
                    ..TriageChange::default()
                },
                "note",
            ),
            (
                "../../etc",
                TriageChange {
                    note: Some("x".into()),
                    ..TriageChange::default()
                },
                "fingerprint",
            ),
        ];
        for (fp, change, expected) in cases {
            let e = store
                .change("c", fp, "oscar", &change)
                .await
                .expect_err("refused");
            assert_eq!(field(e), expected);
        }
        assert_eq!(
            field("done".parse::<TriageStatus>().expect_err("x")),
            "status"
        );
        assert!(
            store.statuses("c").await.expect("statuses").is_empty(),
            "nothing written"
        );
    }
}

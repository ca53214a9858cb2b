//! Who may do what: bearer tokens from a file, each with a role.
//!
//! The tokens file holds SHA-256 hashes, never tokens (a leaked file grants nothing), and
//! is read again when it changes, so removing an entry revokes the token at once:
//!
//! ```toml
//! [[token]]
//! name = "oncall-alice"          # who: written to the audit log
//! role = "operator"              # reader | operator | admin
//! sha256 = "5e88…"               # `reliq admin token` prints the entry
//! expires_at = "2027-01-01T00:00:00Z"   # optional
//! ```
//!
//! A presented token is hashed and compared with every entry in constant time.

use reliq_core::seam::lock;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::AdminError;

/// What a token may do; each role may do everything the one before it may.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Look: stats, ls, show, jobs.
    Reader,
    /// And act: replay, edit, cancel a job.
    Operator,
    /// And destroy: purge.
    Admin,
}

impl Role {
    /// The spelling in the tokens file and the audit log.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reader => "reader",
            Self::Operator => "operator",
            Self::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = AdminError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "reader" => Ok(Self::Reader),
            "operator" => Ok(Self::Operator),
            "admin" => Ok(Self::Admin),
            other => Err(AdminError::InvalidInput {
                field: "role",
                value: other.chars().take(80).collect(),
                expected: "reader, operator or admin".into(),
            }),
        }
    }
}

/// Who a request is, once its token checked out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The token entry's name.
    pub name: String,
    /// Its role.
    pub role: Role,
}

/// Why a token was refused (the API answers 401 for each, and audits the reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer …` header.
    Missing,
    /// The token matches no entry (wrong, or removed from the file).
    Unknown,
    /// The token's entry has expired.
    Expired,
}

impl Refusal {
    /// For the audit log and the error body.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Missing => "missing bearer token",
            Self::Unknown => "unknown token",
            Self::Expired => "expired token",
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    token: Vec<TokenEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    role: Role,
    sha256: String,
    expires_at: Option<String>,
}

#[derive(Debug)]
struct Entry {
    name: String,
    role: Role,
    hash: [u8; 32],
    expires_at: Option<SystemTime>,
}

/// The tokens file, read again whenever its modification time or size changes.
#[derive(Debug)]
pub struct Tokens {
    path: PathBuf,
    loaded: Mutex<Loaded>,
}

/// The entries as last read, and the file's (modification time, size) then.
#[derive(Debug, Default)]
struct Loaded {
    stamp: Option<(SystemTime, u64)>,
    entries: Vec<Entry>,
}

impl Tokens {
    /// Read the tokens file at `path`; an error names the entry and the field.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, AdminError> {
        let tokens = Self {
            path: path.as_ref().to_path_buf(),
            loaded: Mutex::new(Loaded::default()),
        };
        tokens.refresh()?;
        Ok(tokens)
    }

    /// Who `bearer` is, as of the file now.
    pub fn check(&self, bearer: Option<&str>, now: SystemTime) -> Result<Principal, Refusal> {
        let token = bearer.ok_or(Refusal::Missing)?;
        self.check_hash(&hash_token(token), now)
    }

    /// Who the token with SHA-256 `hash` is, as of the file now (a console session keeps
    /// the hash, never the token, and is checked again on every request: a removed or
    /// expired token ends its sessions).
    pub fn check_hash(&self, hash: &[u8; 32], now: SystemTime) -> Result<Principal, Refusal> {
        if let Err(e) = self.refresh() {
            // A file being rewritten: keep the last good entries, say so.
            tracing::warn!(error = %e, "tokens file unreadable; the last good one stays in force");
        }
        let loaded = lock(&self.loaded);
        // Compare with every entry, whatever matched, so timing says nothing.
        let mut found: Option<&Entry> = None;
        for entry in &loaded.entries {
            if bool::from(entry.hash.ct_eq(hash)) {
                found = Some(entry);
            }
        }
        let entry = found.ok_or(Refusal::Unknown)?;
        if entry.expires_at.is_some_and(|t| t <= now) {
            return Err(Refusal::Expired);
        }
        Ok(Principal {
            name: entry.name.clone(),
            role: entry.role,
        })
    }

    fn refresh(&self) -> Result<(), AdminError> {
        let file_error = |source| AdminError::File {
            what: "tokens file",
            path: self.path.display().to_string(),
            source,
        };
        let meta = std::fs::metadata(&self.path).map_err(file_error)?;
        let stamp = (meta.modified().map_err(file_error)?, meta.len());
        {
            let loaded = lock(&self.loaded);
            if loaded.stamp == Some(stamp) {
                return Ok(());
            }
        }
        let text = std::fs::read_to_string(&self.path).map_err(file_error)?;
        let entries = parse(&text).map_err(|why| AdminError::Tokens {
            path: self.path.display().to_string(),
            why,
        })?;
        *lock(&self.loaded) = Loaded {
            stamp: Some(stamp),
            entries,
        };
        Ok(())
    }
}

fn parse(text: &str) -> Result<Vec<Entry>, String> {
    let file: TokensFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut entries = Vec::new();
    for (i, t) in file.token.into_iter().enumerate() {
        let at = format!("token #{} (`{}`)", i + 1, t.name);
        if t.name.is_empty() {
            return Err(format!("{at}: `name` is empty"));
        }
        let mut hash = [0u8; 32];
        hex::decode_to_slice(&t.sha256, &mut hash)
            .map_err(|_| format!("{at}: `sha256` is not 64 hex digits"))?;
        let expires_at = t
            .expires_at
            .as_deref()
            .map(humantime::parse_rfc3339_weak)
            .transpose()
            .map_err(|_| format!("{at}: `expires_at` is not an RFC 3339 time"))?;
        entries.push(Entry {
            name: t.name,
            role: t.role,
            hash,
            expires_at,
        });
    }
    Ok(entries)
}

/// 32 bytes from the OS's random source, as hex: tokens, session ids, CSRF tokens.
pub(crate) fn random_hex() -> Result<String, AdminError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| AdminError::File {
        what: "the OS random source",
        path: "getrandom".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(hex::encode(bytes))
}

/// A new random token (32 bytes from the OS, hex, prefixed `rlq_`) and its tokens-file
/// entry. The token is shown once; only its hash is kept.
pub fn new_token(
    name: &str,
    role: Role,
    expires_at: Option<SystemTime>,
) -> Result<(String, String), AdminError> {
    let token = format!("rlq_{}", random_hex()?);
    let hash = hex::encode(Sha256::digest(token.as_bytes()));
    let mut entry = format!(
        "[[token]]\nname = {}\nrole = \"{}\"\nsha256 = \"{hash}\"\n",
        toml_string(name),
        role.as_str()
    );
    if let Some(t) = expires_at {
        entry.push_str(&format!(
            "expires_at = \"{}\"\n",
            humantime::format_rfc3339_seconds(t)
        ));
    }
    Ok((token, entry))
}

/// The SHA-256 of a token, as the tokens file holds it.
pub fn hash_token(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_new_token_checks_out_with_its_role_and_nothing_else_does() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("tokens.toml");
        let (alice, alice_entry) = new_token("alice", Role::Operator, None)?;
        let soon = SystemTime::now() + Duration::from_secs(60);
        let (bob, bob_entry) = new_token("bob \"the\" reader", Role::Reader, Some(soon))?;
        std::fs::write(&path, format!("{alice_entry}\n{bob_entry}"))?;
        let tokens = Tokens::open(&path)?;
        let now = SystemTime::now();
        assert_eq!(
            tokens.check(Some(&alice), now),
            Ok(Principal {
                name: "alice".into(),
                role: Role::Operator
            })
        );
        assert_eq!(
            tokens.check(Some(&bob), now).map(|p| p.role),
            Ok(Role::Reader)
        );
        assert_eq!(
            tokens.check(Some(&bob), soon + Duration::from_secs(1)),
            Err(Refusal::Expired)
        );
        assert_eq!(tokens.check(Some("rlq_nope"), now), Err(Refusal::Unknown));
        assert_eq!(tokens.check(None, now), Err(Refusal::Missing));
        assert!(
            !std::fs::read_to_string(&path)?.contains(&alice),
            "the file holds the token itself"
        );
        // Removing the entry revokes the token without a restart.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(&path, bob_entry)?;
        assert_eq!(tokens.check(Some(&alice), now), Err(Refusal::Unknown));
        Ok(())
    }

    #[test]
    fn a_bad_file_names_the_entry_and_field() {
        let bad = "[[token]]\nname = \"x\"\nrole = \"operator\"\nsha256 = \"zz\"\n";
        let why = parse(bad).err().unwrap_or_default();
        assert!(
            why.contains("token #1 (`x`)") && why.contains("sha256"),
            "{why}"
        );
        let role = "[[token]]\nname = \"x\"\nrole = \"root\"\nsha256 = \"00\"\n";
        assert!(parse(role).err().unwrap_or_default().contains("role"));
    }
}

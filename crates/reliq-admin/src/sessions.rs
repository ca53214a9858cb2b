//! The web console's signed-in sessions (see the `console` module's docs).

use reliq_core::seam::lock;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::auth::random_hex;
use crate::error::AdminError;
use crate::oidc::SignedIn;

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "reliq_session";

/// How long a session lasts without a new sign-in.
pub(crate) const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);

/// What a session was signed in with.
#[derive(Clone)]
pub(crate) enum Credential {
    /// An API token: its hash, checked against the tokens file on every request.
    Token([u8; 32]),
    /// The identity provider: who it said, until its token expires.
    Provider(SignedIn),
}

struct Session {
    credential: Credential,
    csrf: String,
    started: Instant,
}

/// The console's signed-in sessions (in memory: a restarted server signs everyone out).
#[derive(Default)]
pub struct Sessions(Mutex<HashMap<String, Session>>);

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map(|m| m.len()).unwrap_or(0);
        f.debug_struct("Sessions").field("sessions", &n).finish()
    }
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        lock(&self.0)
    }

    pub(crate) fn start(&self, credential: Credential) -> Result<String, AdminError> {
        let id = random_hex()?;
        let csrf = random_hex()?;
        let mut map = self.lock();
        map.retain(|_, s| s.started.elapsed() < SESSION_TTL);
        map.insert(
            id.clone(),
            Session {
                credential,
                csrf,
                started: Instant::now(),
            },
        );
        Ok(id)
    }

    /// The session's credential and CSRF token, if it is live.
    pub(crate) fn get(&self, id: &str) -> Option<(Credential, String)> {
        let map = self.lock();
        map.get(id)
            .filter(|s| s.started.elapsed() < SESSION_TTL)
            .map(|s| (s.credential.clone(), s.csrf.clone()))
    }

    pub(crate) fn end(&self, id: &str) {
        self.lock().remove(id);
    }
}

//! The web console's signed-in sessions (see the `console` module's docs).

use reliq_core::seam::lock;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::auth::random_hex;
use crate::error::AdminError;

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "reliq_session";

/// How long a session lasts without a new sign-in.
pub(crate) const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);

struct Session {
    token_hash: [u8; 32],
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

    pub(crate) fn start(&self, token_hash: [u8; 32]) -> Result<String, AdminError> {
        let id = random_hex()?;
        let csrf = random_hex()?;
        let mut map = self.lock();
        map.retain(|_, s| s.started.elapsed() < SESSION_TTL);
        map.insert(
            id.clone(),
            Session {
                token_hash,
                csrf,
                started: Instant::now(),
            },
        );
        Ok(id)
    }

    /// The session's token hash and CSRF token, if it is live.
    pub(crate) fn get(&self, id: &str) -> Option<([u8; 32], String)> {
        let map = self.lock();
        map.get(id)
            .filter(|s| s.started.elapsed() < SESSION_TTL)
            .map(|s| (s.token_hash, s.csrf.clone()))
    }

    pub(crate) fn end(&self, id: &str) {
        self.lock().remove(id);
    }
}

//! Failed authentication throttled per client address: past a budget of failures (a
//! missing, wrong, removed or expired token; a refused console sign-in), the address is
//! answered `429 Too Many Requests` with `Retry-After` until the budget allows one more
//! failure, and its credentials are not even checked meanwhile — guessing a token costs a
//! wait per try, whatever the guesses. Other addresses are served as before.
//!
//! The audit log stays bounded: the failures up to the budget are written one by one as
//! before; the 429 answers of a block are not, but counted into one summary record
//! (`throttled`, with the count) written when the address next reaches the server after
//! its block. `reliq_admin_refused_requests_total` counts every refusal by reason.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use reliq_core::seam::lock;

/// `reliq_admin_refused_requests_total{reason}`: requests the admin server refused,
/// by reason (`unauthorized`, `forbidden`, `throttled`).
pub const REFUSED_REQUESTS: &str = "reliq_admin_refused_requests_total";

/// How many failed authentications an address may make (a burst), and how fast the
/// budget refills.
#[derive(Clone, Copy, Debug)]
pub struct AuthBudget {
    /// Failures answered as usual at once; the next one (answered 401 too) starts the
    /// address's block.
    pub burst: NonZeroU32,
    /// One more failure allowed every this long.
    pub refill: Duration,
}

impl Default for AuthBudget {
    /// 10 failures, then one every 6 s (10 a minute).
    fn default() -> Self {
        Self {
            burst: NonZeroU32::new(10).unwrap_or(NonZeroU32::MIN),
            refill: Duration::from_secs(6),
        }
    }
}

/// The failures of each address, and which addresses are blocked until when.
pub(crate) struct AuthThrottle {
    failures: DefaultKeyedRateLimiter<IpAddr>,
    blocked: Mutex<HashMap<IpAddr, Block>>,
}

/// An address over its budget.
struct Block {
    until: Instant,
    /// Refusals answered while blocked and not yet in the audit log.
    unaudited: u64,
}

impl AuthThrottle {
    pub(crate) fn new(budget: AuthBudget) -> Self {
        let quota = Quota::with_period(budget.refill)
            .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
            .allow_burst(budget.burst);
        Self {
            failures: RateLimiter::keyed(quota),
            blocked: Mutex::new(HashMap::new()),
        }
    }

    /// How long `addr` must still wait, when it is blocked; counts the refusal.
    pub(crate) fn refuse(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        let mut blocked = lock(&self.blocked);
        let block = blocked.get_mut(&addr)?;
        if block.until <= now {
            return None;
        }
        block.unaudited += 1;
        Some(block.until - now)
    }

    /// A block that is over, with the refusals it answered and did not audit.
    pub(crate) fn ended(&self, addr: IpAddr, now: Instant) -> Option<u64> {
        let mut blocked = lock(&self.blocked);
        match blocked.get(&addr) {
            Some(b) if b.until <= now => blocked.remove(&addr).map(|b| b.unaudited),
            _ => None,
        }
    }

    /// A failed authentication from `addr`: true when it exhausted the budget (the
    /// address is blocked from now on).
    pub(crate) fn failed(&self, addr: IpAddr, now: Instant) -> bool {
        let Err(not_until) = self.failures.check_key(&addr) else {
            return false;
        };
        let wait = not_until.wait_time_from(DefaultClock::default().now());
        let mut blocked = lock(&self.blocked);
        // Forget addresses whose block is long over, so the map stays small.
        blocked.retain(|_, b| b.until > now);
        blocked.insert(
            addr,
            Block {
                until: now + wait,
                unaudited: 0,
            },
        );
        self.failures.retain_recent();
        true
    }
}

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
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use reliq_core::seam::lock;

use crate::audit::AuditRecord;
use crate::state::{AdminState, AuditNote};

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
    fn refuse(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        let mut blocked = lock(&self.blocked);
        let block = blocked.get_mut(&addr)?;
        if block.until <= now {
            return None;
        }
        block.unaudited += 1;
        Some(block.until - now)
    }

    /// A block that is over, with the refusals it answered and did not audit.
    fn ended(&self, addr: IpAddr, now: Instant) -> Option<u64> {
        let mut blocked = lock(&self.blocked);
        match blocked.get(&addr) {
            Some(b) if b.until <= now => blocked.remove(&addr).map(|b| b.unaudited),
            _ => None,
        }
    }

    /// A failed authentication from `addr`: true when it exhausted the budget (the
    /// address is blocked from now on).
    fn failed(&self, addr: IpAddr, now: Instant) -> bool {
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

/// The middleware: refuses a blocked address before anything else runs, and counts the
/// failed authentications of the others.
pub(crate) async fn throttle_failed_auth(
    State(state): State<Arc<AdminState>>,
    request: Request,
    next: Next,
) -> Response {
    let addr = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let Some(addr) = addr else {
        // No peer address (a router served without connect info): nothing to key on.
        return next.run(request).await;
    };
    let now = Instant::now();
    if let Some(wait) = state.throttle.refuse(addr, now) {
        metrics::counter!(REFUSED_REQUESTS, "reason" => "throttled").increment(1);
        return throttled(wait);
    }
    if let Some(unaudited) = state.throttle.ended(addr, now)
        && unaudited > 0
    {
        state.audit.write(AuditRecord {
            remote: Some(addr.to_string()),
            request: "(throttled requests)".into(),
            action: "throttled".into(),
            outcome: "refused",
            status: 429,
            reason: Some(format!(
                "{unaudited} more request(s) refused while throttled after too many failed \
                 authentications"
            )),
            ..AuditRecord::default()
        });
    }
    let response = next.run(request).await;
    match response.status() {
        StatusCode::UNAUTHORIZED => {
            metrics::counter!(REFUSED_REQUESTS, "reason" => "unauthorized").increment(1);
            if state.throttle.failed(addr, now) {
                tracing::warn!(remote = %addr, "too many failed authentications; address throttled");
            }
        }
        StatusCode::FORBIDDEN => {
            metrics::counter!(REFUSED_REQUESTS, "reason" => "forbidden").increment(1);
        }
        _ => {}
    }
    response
}

/// The 429 answer, kept out of the audit log (the block's summary record counts it).
fn throttled(wait: Duration) -> Response {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let mut response = (
        StatusCode::TOO_MANY_REQUESTS,
        axum::Json(serde_json::json!({
            "error": "too many failed authentications from this address; try again later"
        })),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&seconds.to_string()) {
        response.headers_mut().insert(header::RETRY_AFTER, v);
    }
    response.extensions_mut().insert(AuditNote {
        action: "throttled",
        reason: Some("too many failed authentications".into()),
        unaudited: true,
        ..AuditNote::default()
    });
    response
}

//! The NATS server's clock, as seen from this host.
//!
//! A retry is a scheduled message (`Nats-Schedule: @at <time>`): reliq writes an absolute
//! time and the **server** fires it by its own clock. Written with this host's clock, a
//! host 5 minutes behind the server would schedule every retry in the past (fired at
//! once: no backoff, a retry storm on a dependency that is down), and a host ahead would
//! hold each one for its skew on top of its delay. So the due time is written in the
//! server's terms: this host's time plus the server's offset from it, measured from the
//! `ts` (server time) of a `STREAM.INFO` answer taken halfway through the request's round
//! trip (error: half the round trip), and measured again when older than
//! [`REMEASURE_AFTER`].
//!
//! An offset beyond [`SKEW_WARNING`] is logged as a warning each time it is measured
//! anew: the retries stay right, but `max_age` (the message's `reliq-occurred-at` against
//! this host's clock) and the failure and dead-letter timestamps reliq writes use this
//! host's clock, and are off by that much.

use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream;
use reliq_core::BrokerError;
use reliq_core::seam::headers;
use reliq_core::seam::lock;
use serde::Deserialize;

use crate::error::api;

/// How long a measured offset is used before it is measured again (clocks drift and get
/// stepped by NTP; a measurement costs one request).
pub(crate) const REMEASURE_AFTER: Duration = Duration::from_secs(30);
/// An offset from the server beyond this is warned about.
pub(crate) const SKEW_WARNING: Duration = Duration::from_secs(2);

/// Server time minus this host's time, in milliseconds (signed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offset(i64);

impl Offset {
    /// The offset that makes `local` read as `server`.
    pub(crate) fn between(server: SystemTime, local: SystemTime) -> Self {
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self(match server.duration_since(local) {
            Ok(ahead) => ms(ahead),
            Err(behind) => -ms(behind.duration()),
        })
    }

    /// `local` in the server's terms.
    pub(crate) fn apply(self, local: SystemTime) -> SystemTime {
        let by = Duration::from_millis(self.0.unsigned_abs());
        if self.0 >= 0 { local + by } else { local - by }
    }

    /// How far the clocks are apart.
    pub(crate) fn magnitude(self) -> Duration {
        Duration::from_millis(self.0.unsigned_abs())
    }

    /// Seconds, signed: positive when this host is behind the server.
    pub(crate) fn seconds(self) -> f64 {
        self.0 as f64 / 1000.0
    }
}

/// The server clock estimate one broker connection shares.
#[derive(Debug, Default)]
pub(crate) struct ServerClock {
    measured: std::sync::Mutex<Option<(Offset, Instant)>>,
}

/// The part of a JetStream `STREAM.INFO` answer the measurement reads.
#[derive(Deserialize)]
struct Stamped {
    /// The server's time when it answered (NATS 2.10+).
    ts: Option<String>,
}

impl ServerClock {
    /// Now, in the server's clock: this host's time plus the offset last measured, taken
    /// again through `stream`'s `STREAM.INFO` when older than [`REMEASURE_AFTER`].
    pub(crate) async fn now(
        &self,
        js: &jetstream::Context,
        stream: &str,
    ) -> Result<SystemTime, BrokerError> {
        let fresh = *lock(&self.measured);
        let offset = match fresh {
            Some((offset, at)) if at.elapsed() < REMEASURE_AFTER => offset,
            _ => {
                let offset = measure(js, stream).await?;
                let before = lock(&self.measured).replace((offset, Instant::now()));
                if offset.magnitude() > SKEW_WARNING
                    && before.is_none_or(|(o, _)| o.magnitude() <= SKEW_WARNING)
                {
                    tracing::warn!(
                        offset_seconds = offset.seconds(),
                        "this host's clock is {:.1} s {} the NATS server's: retries are scheduled \
                         in the server's time, but max_age and the failure and dead-letter \
                         timestamps use this host's clock (fix its time sync)",
                        offset.magnitude().as_secs_f64(),
                        if offset.0 > 0 { "behind" } else { "ahead of" }
                    );
                }
                offset
            }
        };
        Ok(offset.apply(SystemTime::now()))
    }
}

/// The server's offset from this host, from one `STREAM.INFO` round trip.
async fn measure(js: &jetstream::Context, stream: &str) -> Result<Offset, BrokerError> {
    let sent = SystemTime::now();
    let clock = Instant::now();
    let answer: Stamped = js
        .request(format!("STREAM.INFO.{stream}"), &())
        .await
        .map_err(api(format!(
            "reading the server's time (STREAM.INFO of `{stream}`)"
        )))?;
    let round_trip = clock.elapsed();
    let ts = answer.ts.ok_or_else(|| {
        BrokerError::connection(format!(
            "STREAM.INFO of `{stream}` carried no server time (`ts`, NATS 2.10+)"
        ))
    })?;
    let server = headers::parse_time(&ts).map_err(|e| {
        BrokerError::connection(format!("the server time `{ts}` of STREAM.INFO")).caused_by(e)
    })?;
    let offset = Offset::between(server, sent + round_trip / 2);
    tracing::debug!(
        offset_ms = offset.0,
        round_trip_ms = round_trip.as_millis() as u64,
        "NATS server clock measured"
    );
    Ok(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_maps_local_time_to_server_time_both_ways() {
        let local = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let behind = Offset::between(local + Duration::from_secs(300), local);
        assert_eq!(behind, Offset(300_000));
        assert_eq!(behind.apply(local), local + Duration::from_secs(300));
        assert_eq!(behind.seconds(), 300.0);
        let ahead = Offset::between(local - Duration::from_millis(1_500), local);
        assert_eq!(ahead, Offset(-1_500));
        assert_eq!(ahead.apply(local), local - Duration::from_millis(1_500));
        assert_eq!(ahead.magnitude(), Duration::from_millis(1_500));
    }
}

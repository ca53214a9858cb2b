use std::time::Duration;

use crate::classify::ErrorClass;
use crate::headers::DeadLetterReason;

/// The longest delay any policy may ask for (SQS visibility timeout's hard limit); longer
/// delays are rejected when the policy is built, never silently clamped.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(12 * 60 * 60);

/// How retry delays grow.
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    /// Fixed tiers used in order; attempts past the last tier reuse the last one. Brokers
    /// with fixed delay queues/topics (Kafka, RabbitMQ) declare one per tier.
    Tiers(Vec<Duration>),
    /// `initial * factor^(n-1)`, capped at `max`.
    Exponential {
        /// Delay after the first failure.
        initial: Duration,
        /// Growth factor (≥ 1).
        factor: f64,
        /// Upper bound.
        max: Duration,
    },
}

/// What to do with a handler panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PanicAction {
    /// Dead-letter at once with reason `panic` (the default: a panic is a bug, and
    /// retrying a bug burns the budget).
    #[default]
    DeadLetter,
    /// Treat like a transient failure; when the budget runs out, dead-letter as `panic`.
    Retry,
}

/// Where a message goes when retries cannot help.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FinalRoute {
    /// The consumer's dead-letter queue (the default).
    #[default]
    DeadLetter,
    /// Acknowledge and drop, counted in `reliq_messages_discarded_total`. Only for data
    /// whose loss is acceptable (samples, heartbeats): opt-in and loud.
    Discard,
}

/// Invalid policy settings, caught when the policy is built.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum PolicyError {
    /// A delay is longer than the 12 h maximum.
    #[error("retry.{field}: {delay:?} is longer than the 12 h maximum delay")]
    DelayTooLong {
        /// The setting.
        field: &'static str,
        /// The delay given.
        delay: Duration,
    },
    /// A setting is outside its range.
    #[error("retry.{field}: {reason}")]
    Invalid {
        /// The setting.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
}

/// A bounded retry budget.
///
/// `max_attempts` counts deliveries, the first one included: `max_attempts(4)` means
/// one try plus up to three retries.
///
/// The retry policy and its decision: a pure function from (failure class, attempt, age)
/// to "retry after this delay" or "dead-letter for this reason".
///
/// ```
/// use std::time::Duration;
/// use reliq_core::{RetryPolicy, Decision, ErrorClass, Failure};
/// let policy = RetryPolicy::tiers([Duration::from_secs(5), Duration::from_secs(30)])
///     .max_age(Duration::from_secs(600))
///     .jitter(0.2);
/// let failure = Failure { class: ErrorClass::Transient, attempt: 1, age: Duration::ZERO };
/// match policy.decide(&failure, 0.5) {
///     Decision::Retry { delay, tier, .. } => {
///         assert_eq!(tier, 0);
///         assert_eq!(delay, Duration::from_millis(5_500)); // 5 s + half of the 20 % jitter
///     }
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RetryPolicy {
    schedule: Schedule,
    max_attempts: u32,
    unknown_max_attempts: u32,
    max_age: Option<Duration>,
    jitter: f64,
    on_panic: PanicAction,
    final_route: FinalRoute,
}

impl Default for RetryPolicy {
    /// Tiers 5 s → 30 s → 5 min, four attempts, 20 % jitter, no max age.
    fn default() -> Self {
        Self::tiers([
            Duration::from_secs(5),
            Duration::from_secs(30),
            Duration::from_secs(300),
        ])
        .jitter(0.2)
    }
}

impl RetryPolicy {
    /// Fixed delay tiers; `max_attempts` defaults to one more than the number of tiers.
    pub fn tiers(delays: impl IntoIterator<Item = Duration>) -> Self {
        let delays: Vec<Duration> = delays.into_iter().collect();
        let max_attempts = u32::try_from(delays.len())
            .unwrap_or(u32::MAX - 1)
            .saturating_add(1);
        Self {
            schedule: Schedule::Tiers(delays),
            max_attempts,
            unknown_max_attempts: 3,
            max_age: None,
            jitter: 0.0,
            on_panic: PanicAction::DeadLetter,
            final_route: FinalRoute::DeadLetter,
        }
    }

    /// Exponential delays (`initial * factor^(n-1)` capped at `max`), 5 attempts.
    pub fn exponential(initial: Duration, factor: f64, max: Duration) -> Self {
        Self {
            schedule: Schedule::Exponential {
                initial,
                factor,
                max,
            },
            max_attempts: 5,
            unknown_max_attempts: 3,
            max_age: None,
            jitter: 0.0,
            on_panic: PanicAction::DeadLetter,
            final_route: FinalRoute::DeadLetter,
        }
    }

    /// No retries: every failure is dead-lettered on the first attempt.
    pub fn no_retry() -> Self {
        Self::tiers([])
    }

    /// Total delivery attempts, the first included (≥ 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Attempts allowed for errors nothing classified (≤ `max_attempts`; default 3).
    pub fn unknown_max_attempts(mut self, n: u32) -> Self {
        self.unknown_max_attempts = n;
        self
    }

    /// The business deadline, measured from when the event occurred (the
    /// `reliq-occurred-at` header) or else from the first failure. A retry that would
    /// fire after it is not scheduled: the message is dead-lettered as `expired`.
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = Some(age);
        self
    }

    /// Spread retries over `[delay, delay * (1 + jitter)]` so failures that happened
    /// together do not retry together. Jitter only ever adds: a retry never fires early.
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.jitter = fraction;
        self
    }

    /// What a panic does.
    pub fn on_panic(mut self, action: PanicAction) -> Self {
        self.on_panic = action;
        self
    }

    /// Where messages go when retries cannot help.
    pub fn final_route(mut self, route: FinalRoute) -> Self {
        self.final_route = route;
        self
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    // Getters carry a `get_` prefix because each setter above already has the plain
    // name (the convention of `std::process::Command`: `arg` / `get_args`).

    /// Total delivery attempts allowed, the first included ([`Self::max_attempts`]).
    pub fn get_max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Attempts allowed for unclassified errors ([`Self::unknown_max_attempts`]).
    pub fn get_unknown_max_attempts(&self) -> u32 {
        self.unknown_max_attempts
    }

    /// The business deadline, if any ([`Self::max_age`]).
    pub fn get_max_age(&self) -> Option<Duration> {
        self.max_age
    }

    /// The jitter fraction ([`Self::jitter`]).
    pub fn get_jitter(&self) -> f64 {
        self.jitter
    }

    /// What a panic does ([`Self::on_panic`]).
    pub fn get_on_panic(&self) -> PanicAction {
        self.on_panic
    }

    /// Where messages go when retries cannot help ([`Self::final_route`]).
    pub fn get_final_route(&self) -> FinalRoute {
        self.final_route
    }

    /// The distinct delays a tiered broker must provision queues/topics for, in tier
    /// order (for an exponential schedule: every delay it can produce).
    pub fn tier_delays(&self) -> Vec<Duration> {
        let retries = self.max_attempts.saturating_sub(1).min(64);
        let mut out: Vec<Duration> = Vec::new();
        for n in 1..=retries {
            let d = self.base_delay(n);
            if out.last() != Some(&d) {
                out.push(d);
            }
        }
        out
    }

    /// Check the settings; called by the consumer builder at startup.
    pub fn validate(&self) -> Result<(), PolicyError> {
        if self.max_attempts == 0 {
            return Err(PolicyError::Invalid {
                field: "max_attempts",
                reason: "must be at least 1 (the first delivery)",
            });
        }
        if !(0.0..=1.0).contains(&self.jitter) || self.jitter.is_nan() {
            return Err(PolicyError::Invalid {
                field: "jitter",
                reason: "must be between 0.0 and 1.0",
            });
        }
        match &self.schedule {
            Schedule::Tiers(tiers) => {
                if tiers.is_empty() && self.max_attempts > 1 {
                    return Err(PolicyError::Invalid {
                        field: "tiers",
                        reason: "retries need at least one delay tier",
                    });
                }
                for d in tiers {
                    if d.mul_f64(1.0 + self.jitter) > MAX_DELAY {
                        return Err(PolicyError::DelayTooLong {
                            field: "tiers",
                            delay: *d,
                        });
                    }
                }
            }
            Schedule::Exponential { factor, max, .. } => {
                if !(*factor >= 1.0 && factor.is_finite()) {
                    return Err(PolicyError::Invalid {
                        field: "factor",
                        reason: "must be a finite number ≥ 1",
                    });
                }
                if max.mul_f64(1.0 + self.jitter) > MAX_DELAY {
                    return Err(PolicyError::DelayTooLong {
                        field: "max",
                        delay: *max,
                    });
                }
            }
        }
        Ok(())
    }

    /// The un-jittered delay after failed attempt `attempt` (1-based).
    fn base_delay(&self, attempt: u32) -> Duration {
        match &self.schedule {
            Schedule::Tiers(tiers) => {
                let i = (attempt.saturating_sub(1) as usize).min(tiers.len().saturating_sub(1));
                tiers.get(i).copied().unwrap_or(Duration::ZERO)
            }
            Schedule::Exponential {
                initial,
                factor,
                max,
            } => {
                let exp = attempt.saturating_sub(1).min(1000) as i32;
                let secs = initial.as_secs_f64() * factor.powi(exp);
                if secs.is_finite() && secs < max.as_secs_f64() {
                    Duration::from_secs_f64(secs)
                } else {
                    *max
                }
            }
        }
    }

    fn tier_index(&self, attempt: u32) -> usize {
        let d = self.base_delay(attempt);
        self.tier_delays().iter().position(|t| *t == d).unwrap_or(0)
    }

    /// Decide what happens after delivery attempt `failure.attempt` failed.
    ///
    /// `random` is a number in `[0, 1)` that picks the jitter (pass a random value in
    /// production, a fixed one in tests). Pure: same inputs, same decision.
    pub fn decide(&self, failure: &Failure, random: f64) -> Decision {
        let budget = match failure.class {
            ErrorClass::Poison => return self.park(DeadLetterReason::Poison),
            ErrorClass::Permanent => return self.park(DeadLetterReason::Permanent),
            ErrorClass::Panic if self.on_panic == PanicAction::DeadLetter => {
                return self.park(DeadLetterReason::Panic);
            }
            ErrorClass::Panic | ErrorClass::Transient => self.max_attempts,
            ErrorClass::Unknown => self.unknown_max_attempts.min(self.max_attempts),
        };
        if failure.attempt >= budget {
            return self.park(if failure.class == ErrorClass::Panic {
                DeadLetterReason::Panic
            } else {
                DeadLetterReason::Exhausted
            });
        }
        let base = self.base_delay(failure.attempt);
        let random = if random.is_finite() {
            random.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let delay = base + base.mul_f64(self.jitter * random);
        if let Some(max_age) = self.max_age {
            // Max age wins over remaining attempts: a retry that would run after the
            // deadline is pointless.
            if failure.age.saturating_add(delay) > max_age {
                return self.park(DeadLetterReason::Expired);
            }
        }
        Decision::Retry {
            delay,
            tier: self.tier_index(failure.attempt),
            next_attempt: failure.attempt + 1,
        }
    }

    fn park(&self, reason: DeadLetterReason) -> Decision {
        match self.final_route {
            FinalRoute::DeadLetter => Decision::DeadLetter(reason),
            FinalRoute::Discard => Decision::Discard(reason),
        }
    }
}

/// One failed attempt, as the policy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Failure {
    /// The failure's class.
    pub class: ErrorClass,
    /// The 1-based delivery attempt that failed.
    pub attempt: u32,
    /// Time since the event occurred (or since the first failure).
    pub age: Duration,
}

/// The outcome of [`RetryPolicy::decide`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    /// Retry after `delay` (tier `tier` on tiered brokers) as attempt `next_attempt`.
    Retry {
        /// How long the broker must hold the message.
        delay: Duration,
        /// Index into [`RetryPolicy::tier_delays`].
        tier: usize,
        /// The attempt number of the retry.
        next_attempt: u32,
    },
    /// Dead-letter for this reason.
    DeadLetter(DeadLetterReason),
    /// Drop (only with [`FinalRoute::Discard`]).
    Discard(DeadLetterReason),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn class() -> impl Strategy<Value = ErrorClass> {
        prop_oneof![
            Just(ErrorClass::Transient),
            Just(ErrorClass::Permanent),
            Just(ErrorClass::Poison),
            Just(ErrorClass::Panic),
            Just(ErrorClass::Unknown),
        ]
    }

    fn policy() -> impl Strategy<Value = RetryPolicy> {
        let tiers = prop::collection::vec(1u64..100_000, 1..6)
            .prop_map(|v| RetryPolicy::tiers(v.into_iter().map(ms)));
        let expo = (1u64..10_000, 1.0f64..4.0, 1u64..1_000_000)
            .prop_map(|(i, f, m)| RetryPolicy::exponential(ms(i), f, ms(m)));
        (
            prop_oneof![tiers, expo],
            1u32..10,
            0.0f64..1.0,
            proptest::option::of(1u64..10_000_000),
            any::<bool>(),
        )
            .prop_map(|(p, attempts, jitter, age, retry_panics)| {
                let p = p.max_attempts(attempts).jitter(jitter);
                let p = if retry_panics {
                    p.on_panic(PanicAction::Retry)
                } else {
                    p
                };
                match age {
                    Some(a) => p.max_age(ms(a)),
                    None => p,
                }
            })
    }

    /// Follow one message through repeated failures of one class.
    fn run_to_end(p: &RetryPolicy, c: ErrorClass, r: f64) -> (u32, Decision) {
        let mut attempt = 1;
        let mut age = Duration::ZERO;
        loop {
            match p.decide(
                &Failure {
                    class: c,
                    attempt,
                    age,
                },
                r,
            ) {
                Decision::Retry {
                    delay,
                    next_attempt,
                    ..
                } => {
                    age += delay;
                    attempt = next_attempt;
                }
                end => return (attempt, end),
            }
        }
    }

    proptest! {
        #[test]
        fn never_more_than_max_attempts(p in policy(), c in class(), r in 0.0f64..1.0) {
            let (attempts, end) = run_to_end(&p, c, r);
            prop_assert!(attempts <= p.get_max_attempts());
            prop_assert!(matches!(end, Decision::DeadLetter(_)));
        }

        #[test]
        fn delays_within_jitter_bounds(p in policy(), attempt in 1u32..10, r in 0.0f64..1.0) {
            let f = Failure { class: ErrorClass::Transient, attempt, age: Duration::ZERO };
            if let Decision::Retry { delay, next_attempt, .. } = p.decide(&f, r) {
                let base = p.base_delay(attempt);
                prop_assert!(delay >= base, "a retry must never fire early");
                prop_assert!(delay <= base + base.mul_f64(p.jitter) + Duration::from_nanos(1));
                prop_assert_eq!(next_attempt, attempt + 1);
            }
        }

        #[test]
        fn max_age_wins_over_remaining_attempts(p in policy(), age_ms in 0u64..20_000_000, r in 0.0f64..1.0) {
            let f = Failure { class: ErrorClass::Transient, attempt: 1, age: ms(age_ms) };
            match p.decide(&f, r) {
                Decision::Retry { delay, .. } => {
                    if let Some(max) = p.get_max_age() { prop_assert!(ms(age_ms) + delay <= max); }
                }
                Decision::DeadLetter(reason) => {
                    let base = p.base_delay(1);
                    let jittered = base + base.mul_f64(p.jitter * r);
                    let expired = p.get_max_age().is_some_and(|max| ms(age_ms) + jittered > max);
                    if p.get_max_attempts() > 1 {
                        prop_assert!(expired);
                        prop_assert_eq!(reason, DeadLetterReason::Expired);
                    }
                }
                Decision::Discard(_) => prop_assert!(false, "no discard configured"),
            }
        }

        #[test]
        fn tiers_used_in_order(tiers in prop::collection::vec(1u64..100_000, 1..6)) {
            let p = RetryPolicy::tiers(tiers.iter().copied().map(ms));
            let mut seen = Vec::new();
            let mut attempt = 1;
            while let Decision::Retry { delay, tier, next_attempt } =
                p.decide(&Failure { class: ErrorClass::Transient, attempt, age: Duration::ZERO }, 0.0)
            {
                prop_assert_eq!(delay, ms(tiers[attempt as usize - 1]));
                prop_assert_eq!(p.tier_delays()[tier], delay);
                seen.push(delay);
                attempt = next_attempt;
            }
            prop_assert_eq!(seen, tiers.iter().copied().map(ms).collect::<Vec<_>>());
        }

        #[test]
        fn poison_and_permanent_never_retry(p in policy(), attempt in 1u32..10) {
            for (c, reason) in [(ErrorClass::Poison, DeadLetterReason::Poison), (ErrorClass::Permanent, DeadLetterReason::Permanent)] {
                prop_assert_eq!(p.decide(&Failure { class: c, attempt, age: Duration::ZERO }, 0.3), Decision::DeadLetter(reason));
            }
        }

        #[test]
        fn unknown_errors_get_the_small_budget(p in policy(), r in 0.0f64..1.0) {
            let p = p.max_age(Duration::MAX);
            let (attempts, _) = run_to_end(&p, ErrorClass::Unknown, r);
            prop_assert!(attempts <= 3.min(p.get_max_attempts()));
        }
    }

    #[test]
    fn delays_over_twelve_hours_are_rejected() {
        let p = RetryPolicy::tiers([Duration::from_secs(13 * 3600)]);
        assert!(matches!(
            p.validate(),
            Err(PolicyError::DelayTooLong { field: "tiers", .. })
        ));
        assert!(RetryPolicy::default().validate().is_ok());
    }

    #[test]
    fn exhausted_after_max_attempts() {
        let p = RetryPolicy::tiers([ms(10), ms(20)]);
        let f = |attempt| Failure {
            class: ErrorClass::Transient,
            attempt,
            age: Duration::ZERO,
        };
        assert!(matches!(p.decide(&f(1), 0.0), Decision::Retry { delay, .. } if delay == ms(10)));
        assert!(matches!(p.decide(&f(2), 0.0), Decision::Retry { delay, .. } if delay == ms(20)));
        assert_eq!(
            p.decide(&f(3), 0.0),
            Decision::DeadLetter(DeadLetterReason::Exhausted)
        );
    }

    #[test]
    fn panics_dead_letter_by_default() {
        let p = RetryPolicy::default();
        let f = Failure {
            class: ErrorClass::Panic,
            attempt: 1,
            age: Duration::ZERO,
        };
        assert_eq!(
            p.decide(&f, 0.0),
            Decision::DeadLetter(DeadLetterReason::Panic)
        );
    }
}

//! # reliq-conformance
//!
//! One portable behaviour suite that every reliq backend must pass. A scenario is an
//! async function over a [`Backend`] factory; [`conformance_suite!`] stamps out one
//! named test per scenario for a backend, at the path
//! `conformance::<backend>::<scenario>`, so
//! `cargo nextest run -E 'test(/conformance::rabbit::/)'` selects one backend.
//!
//! The factory gives each test fresh, isolated names (tests run in parallel and leave
//! nothing shared behind), declares the backend's [`Capabilities`](reliq_core::Capabilities),
//! and offers the fault hooks scenarios need (DLQ unavailable, retry route broken).
//! Time is virtual on the memory backend (`tokio::time::pause`) and real elsewhere, with
//! short delay tiers and explicit tolerances; scenarios wait for conditions with a
//! deadline, never for a fixed sleep.
//!
//! ```text
//! reliq_conformance::conformance_suite!(memory, paused, || MemoryBackend::new());
//! ```

mod contracts;
mod dead_letter_reader;
mod dead_lettering;
mod delivery;
mod flow;
mod lifecycle;
mod operator;
mod retries;
pub mod support;

pub use contracts::*;
pub use dead_letter_reader::*;
pub use dead_lettering::*;
pub use delivery::*;
pub use flow::*;
pub use lifecycle::*;
pub use operator::*;
pub use retries::*;
pub use support::{Backend, Ctx, browse_all};

/// Stamp out one test per scenario for a backend.
///
/// `$backend` becomes the module name (`memory`, `kafka`, `rabbit`, `nats`, `sqs`);
/// scenarios after a `;` are stamped for this backend only, on top of the common list
/// (for a scenario some backends do not pass yet: each such entry is a known gap, named
/// in the backend's test file);
/// `paused` runs each test on a current-thread runtime with tokio's clock paused, `real`
/// on a multi-thread runtime with the real clock; `$factory` is an expression that makes
/// a fresh [`Backend`] for each test.
#[macro_export]
macro_rules! conformance_suite {
    ($backend:ident, $mode:ident, $factory:expr) => {
        $crate::conformance_suite!($backend, $mode, $factory;);
    };
    ($backend:ident, $mode:ident, $factory:expr; $($extra:ident),* $(,)?) => {
        $crate::conformance_suite!(@tests $backend, $mode, $factory,
            publish_consume_ack_keeps_payload_headers_and_id,
            two_groups_each_get_every_message,
            filter_delivers_only_matching_routes,
            group_members_split_without_double_handling,
            ack_only_after_success_nothing_redelivered_after_restart,
            crash_before_ack_redelivers,
            one_transient_failure_retried_after_its_delay,
            k_transient_failures_processed_at_attempt_k_plus_one,
            exhausted_budget_dead_letters_with_max_attempts,
            max_age_dead_letters_as_expired_with_attempts_left,
            permanent_failure_dead_letters_at_once,
            poison_dead_letters_at_once,
            typed_codecs_round_trip_and_undecodable_is_poison,
            panic_dead_letters_and_consumer_survives,
            poison_does_not_block_following_messages,
            dead_letter_metadata_complete_and_decodable,
            retry_keeps_id_key_payload_and_headers,
            dead_letter_unavailable_source_kept_nothing_lost,
            retry_route_failure_keeps_source_and_makes_no_dlq_copy,
            crash_loop_dead_letters_via_delivery_limit,
            max_in_flight_never_exceeded,
            graceful_shutdown_loses_nothing_and_settles_once,
            per_key_order_kept_with_concurrency,
            duplicate_delivery_with_inbox_has_one_effect,
            replay_returns_to_consumer_with_same_id_and_marker,
            replay_twice_with_inbox_has_one_effect,
            non_blocking_retry_lets_later_messages_flow,
            retry_never_fires_early,
            backpressure_bounds_buffered_messages,
            unroutable_publish_fails_loudly,
            batch_handler_settles_each_delivery_by_its_outcome,
            batch_handler_gets_a_backlog_in_batches,
            dead_letter_get_and_remove_by_id,
            dead_letter_copies_count_once,
            dead_letter_count_reports_the_oldest,
            shutdown_with_retries_pending_processes_them_after_restart,
            inbox_outage_then_recovery_is_not_held_back,
            handler_publish_failure_is_classified_by_its_cause,
            settling_on_another_receiver_is_refused,
            dead_letter_pages_cover_every_entry_once,
            dead_letter_filtered_replay_leaves_the_rest,
            dead_letter_browse_changes_nothing,
            dead_letter_browse_cut_short_skips_nothing,
            redeploy_with_another_retry_policy_processes_waiting_retries,
            failure_burst_does_not_hold_back_healthy_messages,
            clean_run_logs_no_warning_or_error,
            operator_stats_ls_and_show_change_nothing,
            operator_replay_dry_run_then_at_a_rate,
            operator_edit_and_purge,
            reads_of_an_unknown_consumer_create_nothing,
            ping_answers_and_creates_nothing,
            backlog_follows_waiting_in_flight_and_retries,
            rate_limit_holds_over_a_backlog,
            topology_check_names_each_difference_from_the_plan,
            circuit_breaker_pauses_consumption_through_an_outage,
            circuit_breaker_stays_closed_through_a_poison_storm
            $(, $extra)*
        );
    };
    (@tests $backend:ident, paused, $factory:expr, $($scenario:ident),+ $(,)?) => {
        pub mod conformance {
            pub mod $backend {
                #[allow(unused_imports)]
                use super::super::*;
                $(
                    #[tokio::test(start_paused = true)]
                    async fn $scenario() -> ::anyhow::Result<()> {
                        let backend = $factory;
                        $crate::$scenario(&backend).await
                    }
                )+
            }
        }
    };
    (@tests $backend:ident, real, $factory:expr, $($scenario:ident),+ $(,)?) => {
        pub mod conformance {
            pub mod $backend {
                #[allow(unused_imports)]
                use super::super::*;
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $scenario() -> ::anyhow::Result<()> {
                        let backend = $factory;
                        $crate::$scenario(&backend).await
                    }
                )+
                // A scenario that also talks to a server beside the broker (the schema
                // registry) needs the real clock: under a paused clock the client's
                // timeouts fire at once. The embedded broker runs it in
                // `integration/tests/contracts.rs`.
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn registry_framed_dead_letter_is_shown_decoded_and_corrected()
                -> ::anyhow::Result<()> {
                    let backend = $factory;
                    $crate::registry_framed_dead_letter_is_shown_decoded_and_corrected(&backend)
                        .await
                }
            }
        }
    };
}

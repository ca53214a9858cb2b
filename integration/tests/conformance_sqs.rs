//! The conformance suite on SQS (the moto endpoint started by scripts/brokers).
//!
//! Tiers, tolerance and backlog are sized for moto, a single Python process (see
//! `SqsBackend`); nextest retries a real-broker scenario once and reports it as FLAKY.

use reliq_integration::sqs::SqsBackend;

reliq_conformance::conformance_suite!(sqs, real, SqsBackend::new();
    dead_letter_pages_cover_every_entry_once,
    dead_letter_filtered_replay_leaves_the_rest,
    dead_letter_browse_changes_nothing,
    dead_letter_browse_cut_short_skips_nothing,
    redeploy_with_another_retry_policy_processes_waiting_retries,
    failure_burst_does_not_hold_back_healthy_messages,
    clean_run_logs_no_warning_or_error,
);

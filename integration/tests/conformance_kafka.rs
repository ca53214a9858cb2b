//! The conformance suite on the real Kafka broker started by `scripts/brokers`.

use reliq_integration::kafka::KafkaBackend;

reliq_conformance::conformance_suite!(kafka, real, KafkaBackend::new();
    dead_letter_pages_cover_every_entry_once,
    failure_burst_does_not_hold_back_healthy_messages,
    dead_letter_browse_changes_nothing,
    dead_letter_browse_cut_short_skips_nothing,
    dead_letter_filtered_replay_leaves_the_rest,
    redeploy_with_another_retry_policy_processes_waiting_retries,
    clean_run_logs_no_warning_or_error,
);

//! The conformance suite on the real Kafka broker started by `scripts/brokers`.

use reliq_integration::kafka::KafkaBackend;

// Not stamped for Kafka yet (issue 18), each a known gap: the transitional dead-letter
// scan cannot remove an entry behind one it keeps (a commit moves past a prefix only),
// so a filtered replay may leave replayed entries in the DLQ, and its reads are
// destructive (dead_letter_browse_changes_nothing, dead_letter_browse_cut_short_skips_nothing,
// dead_letter_filtered_replay_leaves_the_rest); the retry tiers of an earlier policy are
// not drained (redeploy_with_another_retry_policy_processes_waiting_retries); a clean
// stop logs librdkafka errors (clean_run_logs_no_warning_or_error).
reliq_conformance::conformance_suite!(kafka, real, KafkaBackend::new();
    dead_letter_pages_cover_every_entry_once,
    failure_burst_does_not_hold_back_healthy_messages,
);

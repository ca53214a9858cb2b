//! The conformance suite on the embedded broker (virtual time).

use reliq_integration::memory::MemoryBackend;

reliq_conformance::conformance_suite!(memory, paused, MemoryBackend::new();
    dead_letter_pages_cover_every_entry_once,
    dead_letter_filtered_replay_leaves_the_rest,
    dead_letter_browse_changes_nothing,
    dead_letter_browse_cut_short_skips_nothing,
    redeploy_with_another_retry_policy_processes_waiting_retries,
    failure_burst_does_not_hold_back_healthy_messages,
    clean_run_logs_no_warning_or_error,
);

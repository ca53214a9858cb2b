//! The conformance suite on the embedded broker (virtual time).

use reliq_integration::memory::MemoryBackend;

// guide:conformance-suite
reliq_conformance::conformance_suite!(memory, paused, MemoryBackend::new();
    shutdown_while_receiving_holds_nothing_until_a_lease,
);
// guide:end

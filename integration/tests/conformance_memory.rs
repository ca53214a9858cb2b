//! The conformance suite on the embedded broker (virtual time).

use reliq_integration::memory::MemoryBackend;

reliq_conformance::conformance_suite!(memory, paused, MemoryBackend::new());

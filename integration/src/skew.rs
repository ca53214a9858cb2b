//! A wall clock off by a given number of milliseconds for one process, as on a host whose
//! NTP is off: `skew/skew_clock.c` (why not libfaketime: its header), compiled with the
//! system's C compiler and preloaded into the child. Only the wall clock moves; the
//! monotonic clock does not.

use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};

/// The variable the library reads: the skew in milliseconds, signed.
pub const SKEW_MS: &str = "RELIQ_CLOCK_SKEW_MS";

/// Build the skewing library into `dir` (`$CC`, else `cc`): under a fresh name, then
/// renamed into place, so concurrent test processes never load a half-written one.
pub fn library(dir: &Path) -> anyhow::Result<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("skew/skew_clock.c");
    let library = dir.join("libreliq_skew_clock.so");
    let building = dir.join(format!("libreliq_skew_clock.{}.so", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
        .arg(&building)
        .arg(&source)
        .arg("-ldl")
        .output()
        .with_context(|| format!("running the C compiler `{cc}`"))?;
    ensure!(
        out.status.success(),
        "{cc} {}: {}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::rename(&building, &library)?;
    Ok(library)
}

/// The environment that runs a child with its wall clock `skew_ms` off (built into `dir`).
pub fn child_env(dir: &Path, skew_ms: i64) -> anyhow::Result<Vec<(String, String)>> {
    let library = library(dir)?;
    Ok(vec![
        ("LD_PRELOAD".into(), library.display().to_string()),
        (SKEW_MS.into(), skew_ms.to_string()),
    ])
}

/// This process's wall clock, in milliseconds since the Unix epoch (negative before it).
pub fn unix_ms_now() -> i64 {
    match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_millis()).unwrap_or(i64::MAX),
        Err(before) => -i64::try_from(before.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

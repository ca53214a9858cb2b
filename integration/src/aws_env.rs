//! A test's AWS environment: the default credential chain's variables set per test.
//!
//! The chain reads the process environment, so a test that sets it must be alone in its
//! process while it does: nextest runs each test in a process of its own, and under
//! `cargo test` the tests of a binary take turns on a lock.

use anyhow::Context as _;
use reliq_core::seam::lock;

/// Every variable of the default chain (and of endpoints) a machine may have set.
pub const AWS_VARS: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_STS",
    "AWS_ENDPOINT_URL_SQS",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
];

/// Serialises the tests of this binary when they share a process (`cargo test`); under
/// nextest each test has a process of its own.
static ENV_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The test's environment: every `AWS_*` variable of the chain cleared, profile files
/// pointed at a temporary directory (empty unless the test writes them), instance
/// metadata off (no 1 s timeouts probing for an EC2 host), then the test's own.
pub struct Env {
    dir: tempfile::TempDir,
    _lock: std::sync::MutexGuard<'static, ()>,
}

impl Env {
    /// The test's directory; nothing in the environment changed yet.
    pub fn new() -> anyhow::Result<Self> {
        let guard = lock(&ENV_LOCK);
        Ok(Self {
            dir: tempfile::tempdir()?,
            _lock: guard,
        })
    }

    /// The environment of the test: the chain's variables cleared, the profile files in
    /// the test's directory, then `vars`. Call it before any runtime exists.
    pub fn apply(&self, vars: &[(&str, &str)]) -> anyhow::Result<()> {
        let config = self.path("config")?;
        let credentials = self.path("credentials")?;
        let mut all: Vec<(&str, &str)> = vec![
            ("AWS_CONFIG_FILE", &config),
            ("AWS_SHARED_CREDENTIALS_FILE", &credentials),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ];
        all.extend_from_slice(vars);
        replace_env(&all);
        Ok(())
    }

    /// [`Env::new`] and [`Env::apply`].
    pub fn set(vars: &[(&str, &str)]) -> anyhow::Result<Self> {
        let env = Self::new()?;
        env.apply(vars)?;
        Ok(env)
    }

    /// The path of `name` in the test's directory.
    pub fn path(&self, name: &str) -> anyhow::Result<String> {
        Ok(self
            .dir
            .path()
            .join(name)
            .to_str()
            .context("temp path")?
            .to_owned())
    }

    /// Write `name` in the test's directory.
    pub fn write(&self, name: &str, contents: &str) -> anyhow::Result<String> {
        let path = self.path(name)?;
        std::fs::write(&path, contents)?;
        Ok(path)
    }
}

#[allow(unsafe_code)]
fn replace_env(vars: &[(&str, &str)]) {
    for var in AWS_VARS {
        // SAFETY: no other thread of this process reads or writes the environment now:
        // nextest runs each test in a process of its own (and `cargo test` threads wait
        // on ENV_LOCK, held by this test), and the test calls this before it builds a
        // runtime; runtimes made before (e.g. to ask STS for keys) are dropped, their
        // threads joined.
        unsafe { std::env::remove_var(var) };
    }
    for (k, v) in vars {
        // SAFETY: as above.
        unsafe { std::env::set_var(k, v) };
    }
}

/// A runtime for the test's body, built after its environment is set.
pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

//! Where an SQS connection's credentials come from, and how their failures read.
//!
//! Without keys in the URL the AWS **default credential chain** signs every call:
//! environment keys (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`),
//! the shared profile (`AWS_PROFILE` or the URL's `profile=`; static keys, `role_arn` +
//! `source_profile` through STS `AssumeRole`, `web_identity_token_file`), web identity
//! from the environment (`AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN` through STS
//! `AssumeRoleWithWebIdentity`: EKS IRSA), the ECS container endpoint and EC2 instance
//! metadata — resolved lazily, on the first call, and refreshed before they expire.
//!
//! **STS endpoint.** The chain's STS calls go where the connection's STS endpoint is
//! ([`sts_profile_files`]): the URL's `sts_endpoint=`, else the URL's endpoint (emulators
//! serve STS on their one port), else AWS's regional STS. aws-config has no programmatic
//! STS endpoint for the providers it builds, so reliq hands it one the way a user would:
//! an extra, in-memory profile file that points the selected profile's `services` at a
//! section naming STS's `endpoint_url`. `AWS_ENDPOINT_URL_STS` / `AWS_ENDPOINT_URL` in
//! the environment still win (aws-config reads the environment before profiles).
//!
//! **Emulator placeholder.** An endpoint over plain http is an emulator (AWS serves SQS
//! and STS over https only). When nothing configures the chain — no keys, web identity
//! or container variables in the environment, no profile selected (`profile=`,
//! `AWS_PROFILE`), no credentials in the default profile — calls are signed with the
//! placeholder `reliq`/`reliq`, which emulators accept: `sqs://127.0.0.1:4566?region=…`
//! works on a machine without AWS settings, as it always did, and without asking
//! instance metadata (which answers for the host, not for an emulator, and can take a
//! second to time out). This is decided at connect, from local settings only
//! ([`chain_configured`]). Once anything configures the chain, the chain is used, and
//! a source that fails (a role STS refuses, a token file that cannot be read, a selected
//! profile without credentials) is an error, never hidden behind the placeholder. Over
//! https (`tls=true`) and on real AWS (no endpoint) there is no placeholder: no
//! credentials is an error naming what was looked for.

use aws_config::provider_config::ProviderConfig;
use aws_credential_types::Credentials;
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider, future};
use aws_runtime::env_config::file::{EnvConfigFileKind, EnvConfigFiles};
use aws_sdk_sqs::error::{ConnectorError, DisplayErrorContext};
use reliq_core::BrokerError;

/// The `provider_name` of the placeholder credentials (what `Debug` of them shows).
pub(crate) const PLACEHOLDER_PROVIDER: &str = "reliq-emulator-placeholder";
/// The `provider_name` of keys from the URL's user-info.
pub(crate) const URL_PROVIDER: &str = "reliq-url";

/// The services section reliq's extra profile file names.
const SERVICES_SECTION: &str = "reliq-sts";

/// Properties that make a profile a source of credentials.
const CREDENTIAL_PROPERTIES: &[&str] = &[
    "aws_access_key_id",
    "role_arn",
    "web_identity_token_file",
    "credential_process",
    "credential_source",
    "sso_session",
    "sso_start_url",
    "login_session",
];

/// Environment variables that configure a source of the chain.
const CREDENTIAL_VARIABLES: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
];

/// Whether anything local configures the default chain (see the module docs): a profile
/// selected explicitly, a variable of [`CREDENTIAL_VARIABLES`], or a credential property
/// in the default profile of the profile files. A profile file that cannot be parsed
/// counts as configured: the chain then reports what is wrong with it.
pub(crate) async fn chain_configured(profile_selected: bool) -> bool {
    use aws_types::os_shim_internal::{Env, Fs};
    if profile_selected
        || CREDENTIAL_VARIABLES
            .iter()
            .any(|v| std::env::var_os(v).is_some_and(|value| !value.is_empty()))
    {
        return true;
    }
    match aws_config::profile::load(&Fs::real(), &Env::real(), &EnvConfigFiles::default(), None)
        .await
    {
        Ok(profiles) => CREDENTIAL_PROPERTIES
            .iter()
            .any(|p| profiles.get(p).is_some()),
        Err(_) => true,
    }
}

/// The placeholder credentials of an emulator nothing configures the chain for.
pub(crate) fn placeholder() -> Credentials {
    Credentials::new("reliq", "reliq", None, None, PLACEHOLDER_PROVIDER)
}

/// The default chain, whose failures name what was configured.
#[derive(Debug)]
pub(crate) struct Chain {
    chain: SharedCredentialsProvider,
    /// The profile selected by the URL's `profile=` or `AWS_PROFILE`, and the profile
    /// files: when the chain finds nothing, the profile provider says why.
    profile: Option<(String, EnvConfigFiles)>,
    /// For the profile provider asked why the selected profile gave nothing.
    provider_config: ProviderConfig,
}

impl Chain {
    /// `profile`: the explicitly selected profile, if any, and the files the chain
    /// reads.
    pub(crate) fn new(
        chain: SharedCredentialsProvider,
        profile: Option<(String, EnvConfigFiles)>,
        provider_config: ProviderConfig,
    ) -> Self {
        Self {
            chain,
            profile,
            provider_config,
        }
    }

    async fn resolve(&self) -> aws_credential_types::provider::Result {
        match self.chain.provide_credentials().await {
            Ok(c) => Ok(c),
            Err(e) => {
                if let Some(e) = web_identity_unreadable() {
                    return Err(e);
                }
                match (&e, &self.profile) {
                    (CredentialsError::CredentialsNotLoaded(_), Some((name, files))) => {
                        Err(self.profile_failure(name, files, e).await)
                    }
                    _ => Err(e),
                }
            }
        }
    }

    /// Why the selected profile gave nothing: the profile provider's own answer (the
    /// chain only says that no source had credentials).
    async fn profile_failure(
        &self,
        name: &str,
        files: &EnvConfigFiles,
        chain: CredentialsError,
    ) -> CredentialsError {
        #[allow(deprecated)] // `profile_files` takes the type under its old name.
        let provider = aws_config::profile::ProfileFileCredentialsProvider::builder()
            .configure(&self.provider_config)
            .profile_name(name)
            .profile_files(files.clone())
            .build();
        let detail = match provider.provide_credentials().await {
            Err(e) => DisplayErrorContext(&e).to_string(),
            Ok(_) => DisplayErrorContext(&chain).to_string(),
        };
        CredentialsError::invalid_configuration(format!(
            "the selected profile `{name}` gives no credentials: {detail}"
        ))
    }
}

/// `AWS_WEB_IDENTITY_TOKEN_FILE` names a file that cannot be read (aws-config's error
/// says only "No such file or directory").
fn web_identity_unreadable() -> Option<CredentialsError> {
    let path = std::env::var("AWS_WEB_IDENTITY_TOKEN_FILE").ok()?;
    if path.is_empty() {
        return None;
    }
    let e = std::fs::metadata(&path).err()?;
    Some(CredentialsError::invalid_configuration(format!(
        "web identity: AWS_WEB_IDENTITY_TOKEN_FILE names `{path}`, which cannot be read: {e}"
    )))
}

impl ProvideCredentials for Chain {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::new(self.resolve())
    }
}

/// A profile name reliq may write into a profile file's section header.
pub(crate) fn valid_profile_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.+@=,/:".contains(c))
}

/// The profile files aws-config reads (the default ones: `~/.aws/config` and
/// `~/.aws/credentials`, or `AWS_CONFIG_FILE` / `AWS_SHARED_CREDENTIALS_FILE`) plus one
/// in memory that gives `profile` (the selected one) STS's endpoint `sts_endpoint`.
/// A `services` setting that profile has in the user's files is replaced.
pub(crate) fn sts_profile_files(profile: &str, sts_endpoint: &str) -> EnvConfigFiles {
    let header = if profile == "default" {
        "[default]".to_owned()
    } else {
        format!("[profile {profile}]")
    };
    let contents = format!(
        "{header}\nservices = {SERVICES_SECTION}\n\n[services {SERVICES_SECTION}]\nsts =\n  endpoint_url = {sts_endpoint}\n"
    );
    EnvConfigFiles::builder()
        .include_default_config_file(true)
        .include_default_credentials_file(true)
        .with_contents(EnvConfigFileKind::Config, contents)
        .build()
}

/// The credential error in `e`'s source chain, if resolving credentials is what failed.
pub(crate) fn credentials_error<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a CredentialsError> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(c) = err.downcast_ref::<CredentialsError>() {
            return Some(c);
        }
        next = err.source();
    }
    None
}

/// The seam's error for credentials that could not be resolved before `operation`:
/// [`BrokerError::Unauthorized`] naming the cause (a provider that timed out is
/// [`BrokerError::Connection`]: another try may work). Credential errors never carry
/// secrets (aws-config redacts them), only what was looked for and why it failed.
pub(crate) fn credentials_failure(operation: &str, e: &CredentialsError) -> BrokerError {
    let cause = DisplayErrorContext(e).to_string();
    match e {
        CredentialsError::ProviderTimedOut(_) => {
            BrokerError::connection(format!("SQS {operation}: AWS credentials: {cause}"))
        }
        _ if unreachable(e) => BrokerError::connection(format!(
            "SQS {operation}: AWS credentials: their endpoint (STS, container, instance \
             metadata) did not answer: {cause}"
        )),
        CredentialsError::CredentialsNotLoaded(_) => BrokerError::Unauthorized {
            resource: "AWS credentials".into(),
            reason: format!(
                "SQS {operation}: no credentials from the default chain (environment, profile, \
                 web identity, container, instance metadata): {cause}"
            ),
            source: None,
        },
        _ => BrokerError::Unauthorized {
            resource: "AWS credentials".into(),
            reason: format!("SQS {operation}: {cause}"),
            source: None,
        },
    }
}

/// Whether a provider failed because its endpoint could not be reached (another try may
/// work), not because it refused or was misconfigured.
fn unreachable(e: &CredentialsError) -> bool {
    let mut next = std::error::Error::source(e);
    while let Some(err) = next {
        if err
            .downcast_ref::<ConnectorError>()
            .is_some_and(|c| c.is_io() || c.is_timeout())
        {
            return true;
        }
        next = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_names_that_could_break_a_section_header_are_refused() {
        assert!(valid_profile_name("orders-prod"));
        assert!(valid_profile_name("team/orders@eu-west-1"));
        assert!(!valid_profile_name(""));
        assert!(!valid_profile_name("a]\n[b"));
        assert!(!valid_profile_name("with space"));
    }

    #[tokio::test]
    async fn chain_failures_stay_failures_and_read_as_unauthorized() {
        #[derive(Debug)]
        struct Fails(fn() -> CredentialsError);
        impl ProvideCredentials for Fails {
            fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
            where
                Self: 'a,
            {
                future::ProvideCredentials::ready(Err((self.0)()))
            }
        }
        let chain = |f| {
            Chain::new(
                SharedCredentialsProvider::new(Fails(f)),
                None,
                ProviderConfig::empty(),
            )
        };
        let err = chain(|| CredentialsError::not_loaded("nothing here"))
            .provide_credentials()
            .await
            .expect_err("no placeholder in the chain");
        let err = credentials_failure("GetQueueUrl", &err);
        assert!(matches!(err, BrokerError::Unauthorized { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("no credentials from the default chain"),
            "{err}"
        );
        let err = chain(|| CredentialsError::provider_error("AccessDenied: not your role"))
            .provide_credentials()
            .await
            .expect_err("a failure stays one");
        let err = credentials_failure("GetQueueUrl", &err);
        assert!(matches!(err, BrokerError::Unauthorized { .. }), "{err}");
        assert!(err.to_string().contains("not your role"), "{err}");
        let err = credentials_failure(
            "GetQueueUrl",
            &CredentialsError::provider_timed_out(std::time::Duration::from_secs(5)),
        );
        assert!(matches!(err, BrokerError::Connection { .. }), "{err}");
    }

    #[test]
    fn the_extra_profile_file_names_the_sts_endpoint_for_the_selected_profile() {
        let files = format!("{:?}", sts_profile_files("ops", "http://127.0.0.1:4566"));
        // The contents are redacted in Debug; the file set is defaults + one in memory.
        assert!(files.contains("Default(Config)"), "{files}");
        assert!(files.contains("Default(Credentials)"), "{files}");
        assert!(files.contains("FileContents"), "{files}");
    }
}

//! AWS MSK IAM sign-in ([`MskIamSettings`](crate::options::MskIamSettings)): the OAUTHBEARER
//! token an MSK broker accepts is a SigV4 *presigned* `kafka-cluster:Connect` request,
//! base64url-encoded without padding — what AWS's `aws-msk-iam-sasl-signer` libraries
//! make (the unit test pins the Python signer's output for the same inputs).
//!
//! ```text
//! https://kafka.<region>.amazonaws.com/?Action=kafka-cluster%3AConnect
//!   &X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=…&X-Amz-Date=…&X-Amz-Expires=900
//!   &X-Amz-SignedHeaders=host&X-Amz-Security-Token=…&X-Amz-Signature=…&User-Agent=reliq
//! ```
//!
//! librdkafka asks for a token from its own threads, synchronously; the AWS credential
//! providers are async (STS, instance metadata). [`MskIam`] therefore owns a one-worker
//! runtime that resolves credentials, and caches them until five minutes before they
//! expire.

use reliq_core::seam::lock;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use aws_credential_types::provider::{ProvideCredentials as _, SharedCredentialsProvider};
use aws_sigv4::http_request::{
    SignableBody, SignableRequest, SignatureLocation, SigningSettings, sign,
};
use aws_sigv4::sign::v4;
use aws_smithy_http_client::{Builder, tls};
use aws_smithy_types::error::display::DisplayErrorContext;
use base64::Engine as _;

use crate::error::KafkaError;
use crate::options::MskIamSettings;

/// How long a token is valid (AWS's signers use 15 minutes).
pub(crate) const TOKEN_LIFETIME: Duration = Duration::from_secs(900);
const SERVICE: &str = "kafka-cluster";
const USER_AGENT: &str = "reliq";

/// What may stay unencoded in a query value (RFC 3986 unreserved).
const QUERY: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// A token and when it expires.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Token {
    /// The base64url (unpadded) presigned URL.
    pub(crate) value: String,
    /// Milliseconds since the Unix epoch.
    pub(crate) expires_at_ms: i64,
}

/// The MSK IAM token for `region`, signed with `credentials` at `now`.
fn token(region: &str, credentials: &Credentials, now: SystemTime) -> Result<Token, String> {
    let url = format!("https://kafka.{region}.amazonaws.com/?Action=kafka-cluster%3AConnect");
    let identity = credentials.clone().into();
    let mut settings = SigningSettings::default();
    settings.signature_location = SignatureLocation::QueryParams;
    settings.expires_in = Some(TOKEN_LIFETIME);
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(SERVICE)
        .time(now)
        .settings(settings)
        .build()
        .map_err(|e| format!("signing parameters: {e}"))?
        .into();
    let host = format!("kafka.{region}.amazonaws.com");
    let request = SignableRequest::new(
        "GET",
        &url,
        std::iter::once(("host", host.as_str())),
        SignableBody::Bytes(&[]),
    )
    .map_err(|e| format!("the request to sign: {e}"))?;
    let (_, query) = sign(request, &params)
        .map_err(|e| format!("signing: {e}"))?
        .into_parts()
        .0
        .into_parts();
    let mut signed = url;
    // AWS's signers put the signature after the parameters it signs (aws-sigv4 puts
    // the session token after it): the same order here, so the token is theirs byte
    // for byte. The user agent is not signed.
    let (signature, signed_params): (Vec<_>, Vec<_>) = query
        .iter()
        .map(|(n, v)| (*n, v.as_ref()))
        .partition(|(n, _)| *n == "X-Amz-Signature");
    for (name, value) in signed_params
        .into_iter()
        .chain(signature)
        .chain([("User-Agent", USER_AGENT)])
    {
        let value: String = percent_encoding::utf8_percent_encode(value, QUERY).collect();
        signed.push_str(&format!("&{name}={value}"));
    }
    let issued_ms = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|e| format!("the clock is before 1970: {e}"))?
        .as_millis();
    let expires_at_ms = i64::try_from(issued_ms + TOKEN_LIFETIME.as_millis())
        .map_err(|e| format!("expiry out of range: {e}"))?;
    Ok(Token {
        value: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signed),
        expires_at_ms,
    })
}

/// Credentials are fetched again this long before they expire.
const CREDENTIALS_MARGIN: Duration = Duration::from_secs(300);

/// Signs MSK IAM tokens for one connection's clients.
pub(crate) struct MskIam {
    region: String,
    credentials: SharedCredentialsProvider,
    /// Drives the credential providers' requests; shut down in the background on drop
    /// (a runtime must not block while dropped inside another one).
    runtime: Option<tokio::runtime::Runtime>,
    cached: Mutex<Option<Credentials>>,
}

impl MskIam {
    /// The signer for `settings`: the region and credential chain resolved (the
    /// credentials themselves are fetched at the first token).
    pub(crate) fn new(settings: &MskIamSettings) -> Result<Self, KafkaError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("reliq-msk-iam")
            .enable_all()
            .build()
            .map_err(|e| config_error("sasl.oauthbearer.method", format!("its runtime: {e}")))?;
        let http = Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader =
            aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http);
        if let Some(region) = &settings.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        if let Some(profile) = &settings.profile {
            loader = loader.profile_name(profile);
        }
        let sdk = block_on(&runtime, loader.load())?;
        let region = sdk.region().map(ToString::to_string).ok_or_else(|| {
            config_error(
                "reliq.aws.region",
                "MSK IAM signs for the cluster's region: set reliq.aws.region, AWS_REGION or the profile's region".into(),
            )
        })?;
        let credentials = sdk.credentials_provider().ok_or_else(|| {
            config_error("sasl.oauthbearer.method", "no AWS credential chain".into())
        })?;
        Ok(Self {
            region,
            credentials,
            runtime: Some(runtime),
            cached: Mutex::new(None),
        })
    }

    /// A fresh token (blocks while credentials are fetched; callable from any thread).
    pub(crate) fn token(&self) -> Result<Token, String> {
        let credentials = self.credentials()?;
        token(&self.region, &credentials, SystemTime::now())
    }

    fn credentials(&self) -> Result<Credentials, String> {
        let fresh = |c: &Credentials| {
            c.expiry()
                .is_none_or(|at| at > SystemTime::now() + CREDENTIALS_MARGIN)
        };
        if let Some(c) = lock(&self.cached).as_ref().filter(|c| fresh(c)) {
            return Ok(c.clone());
        }
        let runtime = self.runtime.as_ref().ok_or("the signer is shut down")?;
        let provider = self.credentials.clone();
        let c = block_on(runtime, async move { provider.provide_credentials().await })
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("AWS credentials: {}", DisplayErrorContext(&e)))?;
        *lock(&self.cached) = Some(c.clone());
        Ok(c)
    }
}

impl Drop for MskIam {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Run `work` on `runtime` and wait for it here — from a librdkafka thread, a plain
/// thread or inside another runtime's task alike (only this thread waits).
fn block_on<T: Send + 'static>(
    runtime: &tokio::runtime::Runtime,
    work: impl Future<Output = T> + Send + 'static,
) -> Result<T, KafkaError> {
    futures::executor::block_on(runtime.spawn(work)).map_err(|e| {
        config_error(
            "sasl.oauthbearer.method",
            format!("the AWS credential lookup failed: {e}"),
        )
    })
}

fn config_error(field: &str, reason: String) -> KafkaError {
    KafkaError::Config {
        field: field.to_owned(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What AWS's own signer (`aws-msk-iam-sasl-signer-python` 1.0.2, botocore
    /// 1.43) makes for these inputs, its clock fixed at 2026-12-03T12:00:00Z and its
    /// user agent set to `reliq`; the session token has characters that must be
    /// percent-encoded.
    const REFERENCE: &str = "aHR0cHM6Ly9rYWZrYS5ldS13ZXN0LTEuYW1hem9uYXdzLmNvbS8_QWN0aW9uPWthZmthLWNsdXN0ZXIlM0FDb25uZWN0JlgtQW16LUFsZ29yaXRobT1BV1M0LUhNQUMtU0hBMjU2JlgtQW16LUNyZWRlbnRpYWw9QUtJREVYQU1QTEUlMkYyMDI2MTIwMyUyRmV1LXdlc3QtMSUyRmthZmthLWNsdXN0ZXIlMkZhd3M0X3JlcXVlc3QmWC1BbXotRGF0ZT0yMDI2MTIwM1QxMjAwMDBaJlgtQW16LUV4cGlyZXM9OTAwJlgtQW16LVNpZ25lZEhlYWRlcnM9aG9zdCZYLUFtei1TZWN1cml0eS1Ub2tlbj1zZXNzaW9uJTJGdG9rZW4lMkJ3aXRoJTNEY2hhcnMmWC1BbXotU2lnbmF0dXJlPWVlZTI3ZGFmNmM2NTFjOTYxMDgwNDA3OTc0OWJlMjRkMWU3ZDU1MjkwZmU1MTY2NGZiODMwZjM4Y2M0ZDVmYzcmVXNlci1BZ2VudD1yZWxpcQ";

    fn credentials() -> Credentials {
        Credentials::new(
            "AKIDEXAMPLE",
            "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            Some("session/token+with=chars".into()),
            None,
            "test",
        )
    }

    /// 2026-12-03T12:00:00Z.
    fn noon() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_299_200)
    }

    #[test]
    fn the_token_is_what_the_aws_signer_makes_for_the_same_inputs() {
        let t = token("eu-west-1", &credentials(), noon()).expect("a token");
        assert_eq!(t.value, REFERENCE);
        // The Python signer's expiry for it: signing time + 900 s, in milliseconds.
        assert_eq!(t.expires_at_ms, 1_796_300_100_000);
    }

    #[test]
    fn the_token_is_a_presigned_connect_url_in_unpadded_base64url() {
        let t = token("eu-west-1", &credentials(), noon()).expect("a token");
        assert!(!t.value.contains(['=', '+', '/']), "{}", t.value);
        let url = String::from_utf8(
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(&t.value)
                .expect("base64url"),
        )
        .expect("utf-8");
        assert!(
            url.starts_with(
                "https://kafka.eu-west-1.amazonaws.com/?Action=kafka-cluster%3AConnect&"
            ),
            "{url}"
        );
        for part in [
            "X-Amz-Algorithm=AWS4-HMAC-SHA256",
            "X-Amz-Credential=AKIDEXAMPLE%2F20261203%2Feu-west-1%2Fkafka-cluster%2Faws4_request",
            "X-Amz-Date=20261203T120000Z",
            "X-Amz-Expires=900",
            "X-Amz-SignedHeaders=host",
            "X-Amz-Security-Token=session%2Ftoken%2Bwith%3Dchars",
        ] {
            assert!(url.contains(part), "{part} missing from {url}");
        }
        assert!(url.ends_with("&User-Agent=reliq"), "{url}");
        assert!(
            !url.contains("wJalrXUtnFEMI"),
            "the secret key never shows: {url}"
        );
        // Another region, another second: another signature.
        let later =
            token("eu-west-1", &credentials(), noon() + Duration::from_secs(1)).expect("a token");
        let elsewhere = token("us-east-1", &credentials(), noon()).expect("a token");
        assert_ne!(later.value, t.value);
        assert_ne!(elsewhere.value, t.value);
    }
}

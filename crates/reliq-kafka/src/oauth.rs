//! OAUTHBEARER tokens reliq makes itself and hands to librdkafka: AWS MSK IAM
//! ([`MskIamSettings`](crate::options::MskIamSettings)).
//!
//! librdkafka asks a client for a token when OAUTHBEARER has no built-in method (not
//! `oidc`, not the unsecured test JWT), through an event the client's poll loop serves.
//! Producers and consumers poll it, and every context of this crate answers it with
//! [`TokenSource::oauth_token`]. Clients that are not polled never see that event:
//! rdkafka's admin client polls only its own result queue (fede1024/rust-rdkafka#757),
//! and the dead-letter reader's consumer is polled only during a read, after its
//! metadata requests. [`TokenSource::renew`] gives such a client its token directly — at
//! once, and again when 80% of each token's life has passed, as librdkafka does for the
//! others — through `rd_kafka_oauthbearer_set_token`, the one foreign call reliq makes
//! itself: a thread for the admin client ([`keep_signed_in`]), before each read for the
//! reader.

use std::sync::{Arc, Weak, mpsc};
use std::time::{Duration, Instant};

use rdkafka::client::{Client, ClientContext, OAuthToken};

use crate::error::KafkaError;
use crate::msk_iam::MskIam;
use crate::options::KafkaConfig;

/// The principal name librdkafka logs for the token (MSK takes the identity from the
/// signature, not from this name).
const PRINCIPAL: &str = "aws-msk-iam";

/// When a token could not be made, the admin client's sign-in tries again after this.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(10);

/// Where a connection's OAUTHBEARER tokens come from (none: librdkafka's own methods or
/// another mechanism). Cheap to clone; one per [`KafkaBroker`](crate::client::KafkaBroker).
#[derive(Clone, Default)]
pub(crate) struct TokenSource {
    msk_iam: Option<Arc<MskIam>>,
}

impl TokenSource {
    /// The source `config` asks for.
    pub(crate) fn for_config(config: &KafkaConfig) -> Result<Self, KafkaError> {
        Ok(Self {
            msk_iam: match &config.msk_iam {
                Some(settings) => Some(Arc::new(MskIam::new(settings)?)),
                None => None,
            },
        })
    }

    /// Whether reliq makes the tokens (then the admin client needs [`keep_signed_in`]).
    pub(crate) fn is_active(&self) -> bool {
        self.msk_iam.is_some()
    }

    /// A token for librdkafka ([`ClientContext::generate_oauth_token`]). Its error
    /// reaches the client's error callback as an authentication failure, which
    /// [`Refusals`](crate::refusals::Refusals) turns into `Unauthorized`.
    pub(crate) fn oauth_token(&self) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        let Some(signer) = &self.msk_iam else {
            return Err("sasl.mechanism=OAUTHBEARER without a way to get a token: set sasl.oauthbearer.method=oidc (an identity provider) or aws_msk_iam, or enable.sasl.oauthbearer.unsecure.jwt=true (tests only)".into());
        };
        let token = signer.token()?;
        Ok(OAuthToken {
            token: token.value,
            principal_name: PRINCIPAL.into(),
            lifetime_ms: token.expires_at_ms,
        })
    }
}

/// The [`ClientContext`] items that answer librdkafka's token requests from a
/// [`TokenSource`] field: `oauth_token_requests!(tokens);` inside `impl ClientContext`.
macro_rules! oauth_token_requests {
    ($field:tt) => {
        const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

        fn generate_oauth_token(
            &self,
            _: Option<&str>,
        ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
            self.$field.oauth_token()
        }
    };
}
pub(crate) use oauth_token_requests;

/// A context with nothing but the token source: for short-lived consumers.
pub(crate) struct TokenContext(pub(crate) TokenSource);

impl ClientContext for TokenContext {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

    fn generate_oauth_token(
        &self,
        _: Option<&str>,
    ) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        self.0.oauth_token()
    }
}

impl rdkafka::consumer::ConsumerContext for TokenContext {}

/// When a client that is not polled needs its next token (see [`TokenSource::renew`]).
#[derive(Debug, Default)]
pub(crate) struct SignIn {
    renew_at: Option<Instant>,
}

impl TokenSource {
    /// Give `client` a token now if it has none from here or 80% of the last one's life
    /// has passed — for clients librdkafka cannot ask (it asks only in a poll): the admin
    /// client always, the dead-letter reader's consumer between reads. A failure is
    /// logged and reported to the client (its requests then fail as unauthenticated);
    /// the next call tries again after [`RETRY_AFTER_FAILURE`].
    pub(crate) fn renew<C: ClientContext>(&self, client: &Client<C>, sign_in: &mut SignIn) {
        if !self.is_active() || sign_in.renew_at.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let wait = match self.oauth_token() {
            Ok(token) => match set_token(client, &token) {
                Ok(()) => {
                    let life = token.lifetime_ms.saturating_sub(now_ms());
                    Duration::from_millis(u64::try_from(life / 10 * 8).unwrap_or(0))
                }
                Err(e) => {
                    tracing::error!(error = %e, "a Kafka client refused its OAUTHBEARER token");
                    RETRY_AFTER_FAILURE
                }
            },
            Err(e) => {
                tracing::error!(error = %e, "no OAUTHBEARER token for a Kafka client");
                set_token_failure(client, &e.to_string());
                RETRY_AFTER_FAILURE
            }
        };
        sign_in.renew_at = Some(Instant::now() + wait);
    }
}

/// Keep a client that is never polled (the admin client) signed in while its `owner`
/// lives: a thread that [renews](TokenSource::renew) its token when due; `client` finds
/// it in the owner. The thread ends when `stop`'s sender (held by the owner) is dropped.
pub(crate) fn keep_signed_in<T, C>(
    tokens: TokenSource,
    owner: Weak<T>,
    client: fn(&T) -> &Client<C>,
    stop: mpsc::Receiver<()>,
) where
    T: Send + Sync + 'static,
    C: ClientContext + 'static,
{
    let spawned = std::thread::Builder::new()
        .name("reliq-kafka-sign-in".into())
        .spawn(move || {
            let mut sign_in = SignIn::default();
            loop {
                let Some(owner) = owner.upgrade() else { return };
                tokens.renew(client(&owner), &mut sign_in);
                drop(owner);
                let wait = sign_in.renew_at.map_or(RETRY_AFTER_FAILURE, |at| {
                    at.saturating_duration_since(Instant::now())
                });
                if let Err(mpsc::RecvTimeoutError::Disconnected) = stop.recv_timeout(wait) {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "could not start a Kafka client's sign-in thread");
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Give `client` `token` (`rd_kafka_oauthbearer_set_token`).
#[allow(unsafe_code)]
fn set_token<C: ClientContext>(client: &Client<C>, token: &OAuthToken) -> Result<(), String> {
    use std::ffi::{CStr, CString, c_char};
    let value = CString::new(token.token.as_str()).map_err(|e| e.to_string())?;
    let principal = CString::new(token.principal_name.as_str()).map_err(|e| e.to_string())?;
    let mut error: [c_char; 512] = [0; 512];
    // SAFETY: `client.native_ptr()` is a live rd_kafka_t for as long as `client` is
    // borrowed; the strings and the error buffer outlive the call, which copies the
    // strings and writes at most `error.len()` bytes (NUL-terminated) into the buffer;
    // no extensions are passed (null with size 0).
    let code = unsafe {
        rdkafka::bindings::rd_kafka_oauthbearer_set_token(
            client.native_ptr(),
            value.as_ptr(),
            token.lifetime_ms,
            principal.as_ptr(),
            std::ptr::null_mut(),
            0,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if code == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
        Ok(())
    } else {
        // SAFETY: librdkafka wrote a NUL-terminated message into the zeroed buffer.
        Err(unsafe { CStr::from_ptr(error.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}

/// Tell `client` no token could be made: librdkafka reports it through the error
/// callback as an authentication failure (`rd_kafka_oauthbearer_set_token_failure`).
#[allow(unsafe_code)]
fn set_token_failure<C: ClientContext>(client: &Client<C>, reason: &str) {
    let reason = std::ffi::CString::new(reason.replace('\0', " ")).unwrap_or_default();
    // SAFETY: a live rd_kafka_t (as above) and a NUL-terminated string that outlives the
    // call, which copies it.
    unsafe {
        rdkafka::bindings::rd_kafka_oauthbearer_set_token_failure(
            client.native_ptr(),
            reason.as_ptr(),
        );
    }
}

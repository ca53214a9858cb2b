//! The SQS connection: URL parsing, credentials, queue declaration, the topic → queues
//! convention and publishing. The [`Broker`](reliq_core::Broker) implementation is in
//! `broker`.

use reliq_core::{
    BrokerError, Destination, Message, Subscription,
    seam::{lock, secrets::percent_decode},
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::QueueAttributeName;

use aws_credential_types::provider::SharedCredentialsProvider;

use crate::credentials;
use crate::error::{SqsError, sdk_error};
use crate::names::{self, CONSUMER_TAG, FILTER_TAG, ROLE_TAG, SOURCE_TAG};
use crate::options::{MAX_VISIBILITY, SqsOptions};
use crate::{batch, codec};

/// One consumer queue a topic's messages go to.
#[derive(Clone, Debug)]
struct Target {
    url: String,
    filter: Option<String>,
}

/// When a topic's queues were listed, and what they were.
type Listed = (Instant, Arc<Vec<Target>>);

/// A connection to SQS. Cheap to clone.
#[derive(Clone)]
pub struct SqsBroker {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for SqsBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsBroker").finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) client: aws_sdk_sqs::Client,
    sends: batch::Batcher<codec::Encoded>,
    deletes: batch::Batcher<String>,
    pub(crate) options: SqsOptions,
    /// topic → (when listed, its consumer queues).
    topics: Mutex<HashMap<String, Listed>>,
    /// queue url → its target (None: not a consumer queue). Tags do not change.
    tags: Mutex<HashMap<String, Option<(String, Target)>>>,
    /// STS, at the connection's STS endpoint, with the SQS client's credentials.
    sts: Option<aws_sdk_sts::Client>,
    /// What signs the calls (`connect` only).
    credentials: Option<SharedCredentialsProvider>,
    /// The URL's `account=`.
    account: Option<String>,
}

/// Who a connection's credentials belong to ([`SqsBroker::caller_identity`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallerIdentity {
    /// The account id.
    pub account: String,
    /// The principal's ARN (`arn:aws:sts::<account>:assumed-role/<role>/<session>` for
    /// an assumed role).
    pub arn: String,
    /// The principal's unique id.
    pub user_id: String,
}

/// The profile `AWS_PROFILE` selects (aws-config's choice without `profile=` in the
/// URL; `None`: `default`).
fn explicit_profile() -> Result<Option<String>, BrokerError> {
    match std::env::var("AWS_PROFILE") {
        Ok(p) if !p.is_empty() => {
            if credentials::valid_profile_name(&p) {
                Ok(Some(p))
            } else {
                Err(config(
                    "AWS_PROFILE",
                    "a profile name of letters, digits and _-.+@=,/:",
                ))
            }
        }
        _ => Ok(None),
    }
}

/// Where a subscription's queues live.
#[derive(Clone, Debug)]
pub(crate) struct Declared {
    pub(crate) url: String,
    pub(crate) dead_letter_url: String,
}

/// Whole seconds SQS can take for `d`: rounded up (a delay never fires early), ≤ 12 h.
pub(crate) fn whole_seconds(d: Duration) -> i32 {
    let d = d.min(MAX_VISIBILITY);
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs).unwrap_or(i32::MAX)
}

pub(crate) fn config(field: &str, reason: impl Into<String>) -> BrokerError {
    BrokerError::Config {
        field: field.to_owned(),
        reason: reason.into(),
    }
}

/// Keys from the URL's user-info (emulators only). `Debug` shows the key id, never the
/// secret.
#[derive(PartialEq, Eq)]
struct UrlKeys {
    key: String,
    secret: String,
}

impl std::fmt::Debug for UrlKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UrlKeys")
            .field("key", &self.key)
            .field("secret", &"***")
            .finish()
    }
}

/// Where the credential chain's STS calls go.
#[derive(Debug, PartialEq, Eq)]
enum StsEndpoint {
    /// The URL's endpoint, or AWS's regional STS when there is none.
    Same,
    /// `sts_endpoint=aws`: AWS's regional STS even with an endpoint (an SQS VPC endpoint).
    Aws,
    /// `sts_endpoint=<url>`.
    At(String),
}

/// A parsed `sqs://` URL.
#[derive(Debug, PartialEq, Eq)]
struct SqsUrl {
    endpoint: Option<String>,
    region: Option<String>,
    credentials: Option<UrlKeys>,
    fifo: bool,
    /// `profile=`: the shared profile (instead of `AWS_PROFILE`).
    profile: Option<String>,
    sts: StsEndpoint,
    /// `account=`: the account id of generated IAM policies.
    account: Option<String>,
}

impl SqsUrl {
    /// The endpoint the credential chain's STS calls go to (`None`: AWS's).
    fn sts_endpoint(&self) -> Option<&str> {
        match &self.sts {
            StsEndpoint::Same => self.endpoint.as_deref(),
            StsEndpoint::Aws => None,
            StsEndpoint::At(url) => Some(url),
        }
    }

    /// An endpoint over plain http: an emulator (AWS serves https only).
    fn is_emulator(&self) -> bool {
        self.endpoint
            .as_deref()
            .is_some_and(|e| e.starts_with("http://"))
    }
}

const KNOWN_OPTIONS: &str = "known: region, tls, fifo, profile, sts_endpoint, account";

fn parse_url(url: &str) -> Result<SqsUrl, BrokerError> {
    let rest = url.strip_prefix("sqs://").ok_or_else(|| {
        config(
            "url",
            "expected sqs://host:port?region=… or sqs://?region=…",
        )
    })?;
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = authority.trim_end_matches('/');
    let (userinfo, host) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let credentials = match userinfo {
        None => None,
        Some(u) => {
            let (key, secret) = u
                .split_once(':')
                .ok_or_else(|| config("url credentials", "expected KEY:SECRET@"))?;
            Some(UrlKeys {
                key: percent_decode(key).into_owned(),
                secret: percent_decode(secret).into_owned(),
            })
        }
    };
    let mut parsed = SqsUrl {
        endpoint: None,
        region: None,
        credentials,
        fifo: false,
        profile: None,
        sts: StsEndpoint::Same,
        account: None,
    };
    let mut tls = false;
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let v = percent_decode(v);
        match k {
            "region" => parsed.region = Some(v.into_owned()),
            "tls" => tls = v == "true" || v == "1",
            "fifo" => parsed.fifo = v == "true" || v == "1",
            "profile" => {
                if !crate::credentials::valid_profile_name(&v) {
                    return Err(config(
                        "url query `profile`",
                        "a profile name of letters, digits and _-.+@=,/:",
                    ));
                }
                parsed.profile = Some(v.into_owned());
            }
            "sts_endpoint" => {
                parsed.sts = if v == "aws" {
                    StsEndpoint::Aws
                } else if v.starts_with("http://") || v.starts_with("https://") {
                    StsEndpoint::At(v.trim_end_matches('/').to_owned())
                } else {
                    return Err(config(
                        "url query `sts_endpoint`",
                        "expected http://host:port, https://host or `aws` (AWS's regional STS)",
                    ));
                };
            }
            "account" => {
                if v.len() != 12 || !v.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(config(
                        "url query `account`",
                        "an AWS account id: 12 digits",
                    ));
                }
                parsed.account = Some(v.into_owned());
            }
            other => {
                return Err(config(
                    &format!("url query `{other}`"),
                    format!("unknown SQS URL option ({KNOWN_OPTIONS})"),
                ));
            }
        }
    }
    parsed.endpoint = (!host.is_empty()).then(|| {
        let scheme = if tls { "https" } else { "http" };
        format!("{scheme}://{host}")
    });
    if parsed.endpoint.is_none() && parsed.credentials.is_some() {
        return Err(config(
            "url credentials",
            "credentials in the URL need an endpoint; real AWS uses the default credential chain",
        ));
    }
    if parsed.credentials.is_some() && parsed.profile.is_some() {
        return Err(config(
            "url query `profile`",
            "keys in the URL and a profile exclude each other",
        ));
    }
    Ok(parsed)
}

impl SqsBroker {
    /// Connect with default options (see the crate docs for the URL forms).
    pub async fn connect(url: &str) -> Result<Self, BrokerError> {
        Self::connect_with(url, SqsOptions::default()).await
    }

    /// Connect with options. Credentials are resolved on the first call (and refreshed
    /// before they expire), so a credential failure — no credentials, a role STS refuses,
    /// a web identity token file that cannot be read — is that call's error:
    /// [`BrokerError::Unauthorized`] naming the cause (see the crate docs for the sources
    /// and the URL options).
    pub async fn connect_with(url: &str, options: SqsOptions) -> Result<Self, BrokerError> {
        use aws_smithy_http_client::{Builder, tls};
        let parsed = parse_url(url)?;
        let http = Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader =
            aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http.clone());
        if let Some(region) = &parsed.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        } else if parsed.endpoint.is_some() {
            // An emulator: the chain's region (AWS_REGION, the profile), else us-east-1.
            let mut chain = aws_config::default_provider::region::DefaultRegionChain::builder();
            if let Some(profile) = &parsed.profile {
                chain = chain.profile_name(profile);
            }
            loader = loader.region(
                aws_config::meta::region::RegionProviderChain::first_try(chain.build())
                    .or_else(aws_config::Region::new("us-east-1")),
            );
        }
        if let Some(endpoint) = &parsed.endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        if let Some(profile) = &parsed.profile {
            loader = loader.profile_name(profile);
        }
        let sts_endpoint = parsed.sts_endpoint().map(str::to_owned);
        // The profile selected explicitly (URL, then AWS_PROFILE), and the profile files.
        let explicit = match &parsed.profile {
            Some(p) => Some(p.clone()),
            None => explicit_profile()?,
        };
        let profile = explicit.clone().unwrap_or_else(|| "default".to_owned());
        let files = match &sts_endpoint {
            Some(sts) => credentials::sts_profile_files(&profile, sts),
            None => aws_runtime::env_config::file::EnvConfigFiles::default(),
        };
        // Keys in the URL; else the emulator placeholder when nothing configures the
        // chain (decided from local settings, see the `credentials` module); else the
        // default chain, with the STS endpoint in an extra profile file.
        let placeholder = parsed.credentials.is_none()
            && parsed.is_emulator()
            && !credentials::chain_configured(explicit.is_some()).await;
        match &parsed.credentials {
            Some(keys) => {
                loader = loader.credentials_provider(aws_sdk_sqs::config::Credentials::new(
                    keys.key.clone(),
                    keys.secret.clone(),
                    None,
                    None,
                    credentials::URL_PROVIDER,
                ));
            }
            None if placeholder => {
                tracing::debug!(
                    "no AWS credentials configured; signing with the emulator placeholder \
                     (the endpoint is plain http)"
                );
                loader = loader.credentials_provider(credentials::placeholder());
            }
            None => {
                if sts_endpoint.is_some() {
                    loader = loader.profile_files(files.clone());
                }
            }
        }
        let conf = loader.load().await;
        if conf.region().is_none() {
            return Err(config(
                "url region",
                "no region: add ?region=… or configure AWS_REGION",
            ));
        }
        let provider = if parsed.credentials.is_some() || placeholder {
            conf.credentials_provider()
        } else {
            conf.credentials_provider().map(|chain| {
                SharedCredentialsProvider::new(credentials::Chain::new(
                    chain,
                    explicit.map(|name| (name, files)),
                    aws_config::provider_config::ProviderConfig::without_region()
                        .with_http_client(http)
                        .with_region(conf.region().cloned()),
                ))
            })
        };
        let mut sqs = aws_sdk_sqs::config::Builder::from(&conf);
        sqs.set_credentials_provider(provider.clone());
        let mut sts = aws_sdk_sts::config::Builder::from(&conf);
        sts.set_endpoint_url(sts_endpoint);
        sts.set_credentials_provider(provider.clone());
        let options = SqsOptions {
            fifo: options.fifo || parsed.fifo,
            ..options
        };
        Ok(Self::build(
            aws_sdk_sqs::Client::from_conf(sqs.build()),
            options,
            Some(aws_sdk_sts::Client::from_conf(sts.build())),
            provider,
            parsed.account,
        ))
    }

    /// The access key id the connection signs its calls with now (resolving the
    /// credentials if they are not yet: a failure is the error a first call would give).
    /// The key id is no secret (AWS logs it in CloudTrail); the secret is never exposed.
    pub async fn signing_key_id(&self) -> Result<String, BrokerError> {
        use aws_credential_types::provider::ProvideCredentials as _;
        let provider = self
            .inner
            .credentials
            .as_ref()
            .ok_or(BrokerError::Unsupported {
                backend: "sqs",
                what: "signing_key_id on a broker made by from_client",
            })?;
        provider
            .provide_credentials()
            .await
            .map(|c| c.access_key_id().to_owned())
            .map_err(|e| credentials::credentials_failure("(credentials)", &e))
    }

    /// Wrap an existing client (custom credentials, retries, interceptors). Call it inside
    /// a tokio runtime: it starts the send and delete batchers. Such a broker has no STS
    /// client: [`SqsBroker::caller_identity`] is unsupported and generated policies use
    /// `*` for the account.
    pub fn from_client(client: aws_sdk_sqs::Client, options: SqsOptions) -> Self {
        Self::build(client, options, None, None, None)
    }

    /// The broker, with (from `connect`) the STS client for
    /// [`SqsBroker::caller_identity`], the credentials for [`SqsBroker::signing_key_id`]
    /// and the URL's account for generated policies.
    fn build(
        client: aws_sdk_sqs::Client,
        options: SqsOptions,
        sts: Option<aws_sdk_sts::Client>,
        credentials: Option<SharedCredentialsProvider>,
        account: Option<String>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                sends: batch::sends(client.clone(), options.batch_window),
                deletes: batch::deletes(client.clone(), options.batch_window),
                client,
                options,
                topics: Mutex::new(HashMap::new()),
                tags: Mutex::new(HashMap::new()),
                sts,
                credentials,
                account,
            }),
        }
    }

    /// Who the connection's credentials belong to: STS `GetCallerIdentity` (at the
    /// connection's STS endpoint) with the credentials SQS calls are signed with.
    pub async fn caller_identity(&self) -> Result<CallerIdentity, BrokerError> {
        let sts = self.inner.sts.as_ref().ok_or(BrokerError::Unsupported {
            backend: "sqs",
            what: "caller_identity on a broker made by from_client",
        })?;
        let out = sts
            .get_caller_identity()
            .send()
            .await
            .map_err(|e| sdk_error("GetCallerIdentity (STS)", e))?;
        let field = |value: Option<&str>, what: &'static str| {
            value.map(str::to_owned).ok_or_else(|| {
                BrokerError::Other(Box::new(SqsError::Incomplete {
                    operation: "GetCallerIdentity (STS)",
                    what,
                }))
            })
        };
        Ok(CallerIdentity {
            account: field(out.account(), "Account")?,
            arn: field(out.arn(), "Arn")?,
            user_id: field(out.user_id(), "UserId")?,
        })
    }

    /// The account id of generated policies: the URL's `account=`, else STS's answer
    /// (within 5 s), else `None` (`*`).
    pub(crate) async fn policy_account(&self) -> Option<String> {
        if let Some(account) = &self.inner.account {
            return Some(account.clone());
        }
        self.inner.sts.as_ref()?;
        match tokio::time::timeout(Duration::from_secs(5), self.caller_identity()).await {
            Ok(Ok(identity)) => Some(identity.account),
            Ok(Err(e)) => {
                tracing::info!(error = %reliq_core::ErrorChain(&e),
                    "account id unknown: the IAM policy's ARNs use `*` (add account=… to the URL)");
                None
            }
            Err(_) => {
                tracing::info!(
                    "STS GetCallerIdentity took over 5 s: the IAM policy's ARNs use `*` \
                     (add account=… to the URL)"
                );
                None
            }
        }
    }

    /// The underlying client.
    pub fn client(&self) -> &aws_sdk_sqs::Client {
        &self.inner.client
    }

    pub(crate) async fn queue_url(&self, name: &str) -> Result<Option<String>, BrokerError> {
        match self
            .inner
            .client
            .get_queue_url()
            .queue_name(name)
            .send()
            .await
        {
            Ok(out) => Ok(out.queue_url().map(str::to_owned)),
            Err(e) => match sdk_error("GetQueueUrl", e) {
                BrokerError::Unroutable(_) => Ok(None),
                other => Err(other),
            },
        }
    }

    /// Create `name` with `attributes` and `tags`, or bring an existing one up to date.
    /// A FIFO name (`.fifo`) is created with `FifoQueue=true`, which SQS accepts only at
    /// creation.
    async fn ensure_queue(
        &self,
        name: &str,
        attributes: &[(QueueAttributeName, String)],
        tags: &[(&str, String)],
    ) -> Result<String, BrokerError> {
        let client = &self.inner.client;
        if let Some(url) = self.queue_url(name).await? {
            let mut set = client.set_queue_attributes().queue_url(&url);
            for (k, v) in attributes {
                set = set.attributes(k.clone(), v.clone());
            }
            set.send()
                .await
                .map_err(|e| sdk_error("SetQueueAttributes", e))?;
            let mut tag = client.tag_queue().queue_url(&url);
            for (k, v) in tags {
                tag = tag.tags(*k, v.clone());
            }
            tag.send().await.map_err(|e| sdk_error("TagQueue", e))?;
            return Ok(url);
        }
        let mut create = client.create_queue().queue_name(name);
        if names::is_fifo(name) {
            create = create.attributes(QueueAttributeName::FifoQueue, "true");
        }
        for (k, v) in attributes {
            create = create.attributes(k.clone(), v.clone());
        }
        for (k, v) in tags {
            create = create.tags(*k, v.clone());
        }
        let out = create
            .send()
            .await
            .map_err(|e| sdk_error("CreateQueue", e))?;
        out.queue_url().map(str::to_owned).ok_or_else(|| {
            BrokerError::Other(Box::new(SqsError::Incomplete {
                operation: "CreateQueue",
                what: "queue url",
            }))
        })
    }

    pub(crate) async fn queue_arn(&self, url: &str) -> Result<String, BrokerError> {
        let out = self
            .inner
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await
            .map_err(|e| sdk_error("GetQueueAttributes", e))?;
        out.attributes()
            .and_then(|a| a.get(&QueueAttributeName::QueueArn))
            .cloned()
            .ok_or_else(|| {
                BrokerError::Other(Box::new(SqsError::Incomplete {
                    operation: "GetQueueAttributes",
                    what: "QueueArn",
                }))
            })
    }

    /// Declare the subscription's dead-letter queue (idempotent; messages kept 14 days,
    /// the SQS maximum). Returns its URL.
    pub async fn declare_dead_letters(&self, sub: &Subscription) -> Result<String, BrokerError> {
        self.ensure_queue(
            &names::dead_letter_queue_name(sub, self.inner.options.fifo),
            &[(
                QueueAttributeName::MessageRetentionPeriod,
                crate::topology::DEAD_LETTER_RETENTION_SECS.to_string(),
            )],
            &[
                (ROLE_TAG, "dead-letter".into()),
                (SOURCE_TAG, sub.source.clone()),
                (CONSUMER_TAG, sub.consumer.clone()),
            ],
        )
        .await
    }

    /// The names of every queue whose name starts with `prefix`, sorted (for tests that
    /// check an operation created nothing). Feature `test-util`.
    #[cfg(feature = "test-util")]
    pub async fn queue_names(&self, prefix: &str) -> Result<Vec<String>, BrokerError> {
        let mut names: Vec<String> = self
            .queue_urls(prefix)
            .await?
            .iter()
            .filter_map(|url| url.rsplit('/').next().map(str::to_owned))
            .collect();
        names.sort();
        Ok(names)
    }

    /// Delete the subscription's dead-letter queue (for fault-injection tests: the DLQ
    /// becomes unavailable; [`SqsBroker::declare_dead_letters`] restores it). Feature
    /// `test-util`.
    #[cfg(feature = "test-util")]
    pub async fn delete_dead_letters(&self, sub: &Subscription) -> Result<(), BrokerError> {
        if let Some(url) = self
            .queue_url(&names::dead_letter_queue_name(sub, self.inner.options.fifo))
            .await?
        {
            self.inner
                .client
                .delete_queue()
                .queue_url(url)
                .send()
                .await
                .map_err(|e| sdk_error("DeleteQueue", e))?;
        }
        Ok(())
    }

    /// Declare the subscription's queues (idempotent): the DLQ, then the consumer queue
    /// with its redrive policy, then the DLQ's redrive-allow policy.
    pub(crate) async fn declare(&self, sub: &Subscription) -> Result<Declared, BrokerError> {
        let dead_letter_url = self.declare_dead_letters(sub).await?;
        let dead_letter_arn = self.queue_arn(&dead_letter_url).await?;
        let redrive = serde_json::json!({
            "deadLetterTargetArn": dead_letter_arn,
            "maxReceiveCount": crate::topology::max_receive_count(sub),
        });
        let mut tags = vec![
            (ROLE_TAG, "consumer".to_owned()),
            (SOURCE_TAG, sub.source.clone()),
            (CONSUMER_TAG, sub.consumer.clone()),
        ];
        if let Some(filter) = sub.filter.as_ref().filter(|f| f.as_str() != "#") {
            tags.push((FILTER_TAG, filter.clone()));
        }
        let url = self
            .ensure_queue(
                &names::queue_name(sub, self.inner.options.fifo),
                &[
                    (
                        QueueAttributeName::VisibilityTimeout,
                        whole_seconds(sub.lease).max(1).to_string(),
                    ),
                    (QueueAttributeName::RedrivePolicy, redrive.to_string()),
                ],
                &tags,
            )
            .await?;
        let source_arn = self.queue_arn(&url).await?;
        let allow = serde_json::json!({
            "redrivePermission": "byQueue",
            "sourceQueueArns": [source_arn],
        });
        if let Err(e) = self
            .inner
            .client
            .set_queue_attributes()
            .queue_url(&dead_letter_url)
            .attributes(QueueAttributeName::RedriveAllowPolicy, allow.to_string())
            .send()
            .await
        {
            // Not every emulator knows the attribute; the redrive policy works without it.
            tracing::warn!(error = %DisplayErrorContext(&e), "cannot set the DLQ's RedriveAllowPolicy");
        }
        self.forget_topic(&sub.source);
        Ok(Declared {
            url,
            dead_letter_url,
        })
    }

    /// Ask SQS to move the subscription's dead letters back to its queue with a
    /// server-side `StartMessageMoveTask` (at most `per_second` messages per second, SQS's
    /// default rate when `None`). Returns the task handle, or `None` when the endpoint
    /// does not run one — emulators (moto answers HTTP 500) and any other refusal, which
    /// is logged: then redrive with the portable replay engine
    /// ([`reliq_core::Replay`]), which works on every endpoint, strips the failure
    /// headers and marks the copies as replayed. A move task keeps each message as it
    /// is (the dead-letter record stays in its attributes).
    pub async fn start_message_move_task(
        &self,
        sub: &Subscription,
        per_second: Option<i32>,
    ) -> Result<Option<String>, BrokerError> {
        let dead_letter_url = self.declare_dead_letters(sub).await?;
        let name = names::queue_name(sub, self.inner.options.fifo);
        let url = self
            .queue_url(&name)
            .await?
            .ok_or(BrokerError::Unroutable(name))?;
        let (source, destination) = (
            self.queue_arn(&dead_letter_url).await?,
            self.queue_arn(&url).await?,
        );
        match self
            .inner
            .client
            .start_message_move_task()
            .source_arn(source)
            .destination_arn(destination)
            .set_max_number_of_messages_per_second(per_second)
            .send()
            .await
        {
            Ok(out) => Ok(out.task_handle().map(str::to_owned)),
            Err(e) => {
                tracing::warn!(error = %DisplayErrorContext(&e), "StartMessageMoveTask refused; redrive with the replay engine instead");
                Ok(None)
            }
        }
    }

    /// Messages of the subscription's queue that are received and not yet deleted, or
    /// waiting out a retry delay (`ApproximateNumberOfMessagesNotVisible`).
    pub async fn not_visible(&self, sub: &Subscription) -> Result<usize, BrokerError> {
        let url = self
            .queue_url(&names::queue_name(sub, self.inner.options.fifo))
            .await?
            .ok_or_else(|| {
                BrokerError::Unroutable(names::queue_name(sub, self.inner.options.fifo))
            })?;
        let out = self
            .inner
            .client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .map_err(|e| sdk_error("GetQueueAttributes", e))?;
        Ok(out
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::ApproximateNumberOfMessagesNotVisible))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0))
    }

    /// One `ListQueues` call returning at most one URL (the `ping` of the seam).
    pub(crate) async fn list_one_queue(&self) -> Result<(), BrokerError> {
        self.inner
            .client
            .list_queues()
            .max_results(1)
            .send()
            .await
            .map(drop)
            .map_err(|e| sdk_error("ListQueues", e))
    }

    /// The URL of every queue whose name starts with `prefix` (ListQueues, every page).
    async fn queue_urls(&self, prefix: &str) -> Result<Vec<String>, BrokerError> {
        let mut urls = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let out = self
                .inner
                .client
                .list_queues()
                .queue_name_prefix(prefix)
                .max_results(1000)
                .set_next_token(next.take())
                .send()
                .await
                .map_err(|e| sdk_error("ListQueues", e))?;
            urls.extend(out.queue_urls().iter().cloned());
            match out.next_token() {
                Some(t) if !t.is_empty() => next = Some(t.to_owned()),
                _ => break,
            }
        }
        Ok(urls)
    }

    pub(crate) fn forget_topic(&self, topic: &str) {
        lock(&self.inner.topics).remove(topic);
    }

    /// The consumer queues of `topic` (cached for [`SqsOptions::topic_cache_ttl`]).
    async fn targets(&self, topic: &str) -> Result<Arc<Vec<Target>>, BrokerError> {
        if let Some((at, targets)) = lock(&self.inner.topics).get(topic)
            && at.elapsed() < self.inner.options.topic_cache_ttl
        {
            return Ok(targets.clone());
        }
        let urls = self.queue_urls(&names::topic_prefix(topic)).await?;
        let mut targets = Vec::new();
        for url in urls {
            let known = lock(&self.inner.tags).get(&url).cloned();
            let target = match known {
                Some(t) => t,
                None => {
                    let out = match self
                        .inner
                        .client
                        .list_queue_tags()
                        .queue_url(&url)
                        .send()
                        .await
                    {
                        Ok(out) => out,
                        Err(e) => match sdk_error("ListQueueTags", e) {
                            // Deleted since it was listed.
                            BrokerError::Unroutable(_) => continue,
                            other => return Err(other),
                        },
                    };
                    let tags = out.tags();
                    let t = tags
                        .and_then(|t| {
                            (t.get(ROLE_TAG).map(String::as_str) == Some("consumer")).then_some(t)
                        })
                        .and_then(|t| t.get(SOURCE_TAG))
                        .map(|source| {
                            (
                                source.clone(),
                                Target {
                                    url: url.clone(),
                                    filter: tags.and_then(|t| t.get(FILTER_TAG)).cloned(),
                                },
                            )
                        });
                    lock(&self.inner.tags).insert(url.clone(), t.clone());
                    t
                }
            };
            if let Some((source, target)) = target
                && source == topic
            {
                targets.push(target);
            }
        }
        let targets = Arc::new(targets);
        if !targets.is_empty() {
            lock(&self.inner.topics).insert(topic.to_owned(), (Instant::now(), targets.clone()));
        }
        Ok(targets)
    }

    /// Send `encoded` (made from `message`) to the queue at `url`; a FIFO queue gets the
    /// message's group and `dedup` as its deduplication id.
    pub(crate) async fn send(
        &self,
        url: &str,
        encoded: &codec::Encoded,
        message: &Message,
        dedup: &str,
    ) -> Result<(), BrokerError> {
        let entry = if names::is_fifo(url) {
            encoded.for_fifo(message.key(), dedup)
        } else {
            encoded.clone()
        };
        self.inner.sends.send(url, entry).await
    }

    pub(crate) async fn delete(&self, url: &str, receipt: &str) -> Result<(), BrokerError> {
        self.inner.deletes.delete(url, receipt).await
    }

    pub(crate) async fn publish_once(
        &self,
        destination: &Destination,
        encoded: &codec::Encoded,
        message: &Message,
    ) -> Result<(), BrokerError> {
        let targets = self.targets(&destination.topic).await?;
        let route = destination.route.as_deref();
        let chosen: Vec<&Target> = targets
            .iter()
            .filter(|t| names::filter_matches(t.filter.as_deref(), route))
            .collect();
        if chosen.is_empty() {
            return Err(BrokerError::Unroutable(destination.to_string()));
        }
        let results = futures::future::join_all(
            chosen
                .iter()
                .map(|t| self.send(&t.url, encoded, message, message.id().as_str())),
        )
        .await;
        results.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_without_leaking_secrets() {
        let u = parse_url("sqs://127.0.0.1:4566?region=us-east-1").expect("url");
        assert_eq!(u.endpoint.as_deref(), Some("http://127.0.0.1:4566"));
        assert_eq!(u.region.as_deref(), Some("us-east-1"));
        assert!(u.is_emulator());
        let u = parse_url("sqs://?region=eu-west-1").expect("url");
        assert_eq!(u.endpoint, None);
        assert!(!u.is_emulator());
        let u = parse_url("sqs://AK:s%2Fcret@h:1?tls=true").expect("url");
        assert_eq!(u.endpoint.as_deref(), Some("https://h:1"));
        assert!(
            !u.is_emulator(),
            "https is AWS or a proxy of it: no placeholder"
        );
        let keys = u.credentials.as_ref().expect("keys");
        assert_eq!((keys.key.as_str(), keys.secret.as_str()), ("AK", "s/cret"));
        let debug = format!("{u:?}");
        assert!(debug.contains("AK") && !debug.contains("s/cret"), "{debug}");
        let err = parse_url("sqs://h:1?bogus=1").expect_err("unknown option");
        assert!(err.to_string().contains("bogus"));
        assert!(err.to_string().contains("sts_endpoint"), "{err}");
        let err = parse_url("sqs://AK:secret@?region=x").expect_err("needs endpoint");
        assert!(!err.to_string().contains("secret@"));
    }

    #[test]
    fn the_chain_options_parse_and_the_sts_endpoint_follows_the_endpoint() {
        let u = parse_url("sqs://127.0.0.1:4566?region=us-east-1&profile=ops&account=123456789012")
            .expect("url");
        assert_eq!(u.profile.as_deref(), Some("ops"));
        assert_eq!(u.account.as_deref(), Some("123456789012"));
        assert_eq!(u.sts_endpoint(), Some("http://127.0.0.1:4566"));
        let u = parse_url("sqs://?region=eu-west-1").expect("url");
        assert_eq!(u.sts_endpoint(), None, "real AWS: AWS's STS");
        let u = parse_url("sqs://vpce.example:443?tls=true&sts_endpoint=aws").expect("url");
        assert_eq!(u.sts_endpoint(), None, "sts_endpoint=aws: AWS's STS");
        let u = parse_url("sqs://?region=eu-west-1&sts_endpoint=http%3A%2F%2F127.0.0.1%3A4566%2F")
            .expect("url");
        assert_eq!(u.sts_endpoint(), Some("http://127.0.0.1:4566"));
        for (url, field) in [
            ("sqs://h:1?sts_endpoint=ftp://x", "sts_endpoint"),
            ("sqs://h:1?account=12", "account"),
            ("sqs://h:1?profile=a%5D%0A%5Bb", "profile"),
            ("sqs://AK:S@h:1?profile=ops", "profile"),
        ] {
            let err = parse_url(url).expect_err(url);
            assert!(
                matches!(&err, BrokerError::Config { field: f, .. } if f.contains(field)),
                "{url}: {err}"
            );
        }
    }

    #[test]
    fn delays_round_up_to_whole_seconds_and_cap_at_12h() {
        assert_eq!(whole_seconds(Duration::ZERO), 0);
        assert_eq!(whole_seconds(Duration::from_millis(1)), 1);
        assert_eq!(whole_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(whole_seconds(Duration::from_secs(2)), 2);
        assert_eq!(whole_seconds(Duration::from_secs(100_000)), 43_200);
    }
}

//! A client of the Confluent Schema Registry REST API (Confluent's server, Apicurio
//! Registry's `/apis/ccompat/v7`, Karapace, Redpanda): register, look up, fetch by id,
//! compatibility — with the caches that take the registry out of the steady-state path.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use reliq_core::seam::secrets::redact_url;
use serde::{Deserialize, Serialize};

/// The kinds of schema a registry stores (its `schemaType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum SchemaType {
    /// An Avro schema (JSON text). The registry's default when `schemaType` is absent.
    Avro,
    /// A `.proto` file.
    Protobuf,
    /// A JSON Schema document.
    Json,
}

/// A schema as the registry holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisteredSchema {
    /// The registry's id (what the wire format carries).
    pub id: u32,
    /// Its kind.
    pub schema_type: SchemaType,
    /// The schema text.
    pub schema: String,
}

/// How a schema's subject is named (Confluent's `SubjectNameStrategy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SubjectStrategy {
    /// `<topic>-value`: one schema (and its evolutions) per topic. The default.
    #[default]
    TopicName,
    /// `<record name>`: a record type shared by every topic that carries it.
    RecordName,
    /// `<topic>-<record name>`: several record types on one topic.
    TopicRecordName,
}

impl SubjectStrategy {
    /// The subject for a value of `record` (its fully qualified name) on `topic`.
    pub fn subject(self, topic: &str, record: &str) -> String {
        match self {
            Self::TopicName => format!("{topic}-value"),
            Self::RecordName => record.to_owned(),
            Self::TopicRecordName => format!("{topic}-{record}"),
        }
    }
}

/// A registry request failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registry could not be reached, did not answer in time or answered 5xx:
    /// another try may succeed.
    #[error("schema registry unavailable: {context}")]
    Unavailable {
        /// What was asked, and what went wrong.
        context: String,
        /// The HTTP client's error, if any.
        #[source]
        source: Option<reqwest::Error>,
    },
    /// The registry answered that it does not have it (404: subject, version or id).
    #[error("not in the schema registry: {0}")]
    NotFound(String),
    /// The registry refused the request (409 incompatible, 422 invalid schema, 401/403):
    /// the same request is refused again.
    #[error("the schema registry refused {what}: HTTP {status}, error {code}: {message}")]
    Refused {
        /// What was asked.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The registry's `error_code`.
        code: i64,
        /// The registry's `message`.
        message: String,
    },
    /// The registry's URL is not usable.
    #[error("invalid schema registry URL `{url}`: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong.
        reason: String,
    },
}

impl From<RegistryError> for reliq_core::CodecError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::Unavailable { .. } => Self::Unavailable {
                context: e.to_string(),
                source: Some(Box::new(e)),
            },
            other => Self::Unencodable(other.to_string()),
        }
    }
}

/// The media type of the registry's API.
const CONTENT_TYPE: &str = "application/vnd.schemaregistry.v1+json";

/// A Confluent-compatible schema registry, with caches:
///
/// - schemas by id, forever (an id's schema never changes): a consumer asks once per
///   writer schema it meets;
/// - ids by (subject, schema), forever: a producer registers or looks up once per
///   subject and schema.
///
/// [`SchemaRegistry::requests`] counts the HTTP requests made, to show that.
///
/// ```no_run
/// # async fn f() -> Result<(), reliq_contracts::RegistryError> {
/// use reliq_contracts::{SchemaRegistry, SchemaType};
/// let registry = SchemaRegistry::new("http://127.0.0.1:8081/apis/ccompat/v7")?;
/// let id = registry.register("orders-value", SchemaType::Avro, r#"{"type":"string"}"#).await?;
/// assert_eq!(registry.schema(id).await?.schema_type, SchemaType::Avro);
/// # Ok(()) }
/// ```
pub struct SchemaRegistry {
    http: reqwest::Client,
    base: String,
    credentials: Option<(String, String)>,
    by_id: RwLock<HashMap<u32, Arc<RegisteredSchema>>>,
    ids: RwLock<HashMap<(String, String), u32>>,
    requests: AtomicU64,
}

impl std::fmt::Debug for SchemaRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchemaRegistry")
            .field("base", &self.base)
            .field(
                "credentials",
                &self.credentials.as_ref().map(|_| "<redacted>"),
            )
            .finish_non_exhaustive()
    }
}

/// How long one request may take before the registry counts as unavailable.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

impl SchemaRegistry {
    /// A client of the registry whose API is at `url` (Confluent: `http://host:8081`;
    /// Apicurio: `http://host:8080/apis/ccompat/v7`), plain HTTP or HTTPS with the
    /// platform's roots. For a private CA, client certificates or a proxy, build the
    /// `reqwest::Client` yourself: [`SchemaRegistry::with_client`].
    pub fn new(url: &str) -> Result<Self, RegistryError> {
        let setup = |e: &dyn std::fmt::Display| RegistryError::Url {
            url: redact_url(url),
            reason: format!("cannot build the HTTP client: {e}"),
        };
        // rustls on ring (as every TLS stack of reliq), verifying with the platform's roots.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls_platform_verifier::Verifier::new(provider.clone()).map_err(|e| setup(&e))?;
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| setup(&e))?
            .dangerous() // only to install the platform verifier, which verifies fully
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| setup(&e))?;
        Self::with_client(url, http)
    }

    /// A client of the registry at `url` over `http`. A user and password in the URL
    /// (`https://KEY:SECRET@host`) become its basic authentication, as
    /// [`SchemaRegistry::basic_auth`] gives it; they are kept out of `Debug` and errors.
    pub fn with_client(url: &str, http: reqwest::Client) -> Result<Self, RegistryError> {
        let invalid = |reason: String| RegistryError::Url {
            url: redact_url(url),
            reason,
        };
        let mut parsed = reqwest::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(invalid("the scheme must be http or https".into()));
        }
        let credentials = (!parsed.username().is_empty()).then(|| {
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8_lossy()
                    .into_owned()
            };
            (
                decode(parsed.username()),
                decode(parsed.password().unwrap_or_default()),
            )
        });
        // Infallible for http(s) URLs, which have a host.
        let _ = parsed.set_username("");
        let _ = parsed.set_password(None);
        Ok(Self {
            http,
            base: parsed.as_str().trim_end_matches('/').to_owned(),
            credentials,
            by_id: RwLock::default(),
            ids: RwLock::default(),
            requests: AtomicU64::new(0),
        })
    }

    /// Sign in with HTTP basic authentication (Confluent Cloud: an API key and secret).
    pub fn basic_auth(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.credentials = Some((user.into(), password.into()));
        self
    }

    /// HTTP requests made so far (cache hits make none).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Register `schema` under `subject` (a new version, or the id of the same schema
    /// already there); returns its id. The registry checks compatibility with the
    /// subject's earlier versions and refuses an incompatible one
    /// ([`RegistryError::Refused`], 409).
    pub async fn register(
        &self,
        subject: &str,
        schema_type: SchemaType,
        schema: &str,
    ) -> Result<u32, RegistryError> {
        self.id_for(subject, schema_type, schema, "versions").await
    }

    /// The id of `schema` if it is registered under `subject`; does not register it
    /// ([`RegistryError::NotFound`] when it is not there).
    pub async fn lookup(
        &self,
        subject: &str,
        schema_type: SchemaType,
        schema: &str,
    ) -> Result<u32, RegistryError> {
        self.id_for(subject, schema_type, schema, "").await
    }

    async fn id_for(
        &self,
        subject: &str,
        schema_type: SchemaType,
        schema: &str,
        path: &str,
    ) -> Result<u32, RegistryError> {
        let key = (subject.to_owned(), schema.to_owned());
        if let Some(id) = read(&self.ids).get(&key) {
            return Ok(*id);
        }
        #[derive(Deserialize)]
        struct Answer {
            id: u32,
        }
        let what = if path.is_empty() {
            format!("looking up a schema under `{subject}`")
        } else {
            format!("registering a schema under `{subject}`")
        };
        let url = format!("{}/subjects/{}/{path}", self.base, encode(subject));
        let answer: Answer = self
            .send(
                &what,
                self.http.post(url.trim_end_matches('/')).json(&SchemaBody {
                    schema,
                    schema_type,
                }),
            )
            .await?;
        write(&self.ids).insert(key, answer.id);
        Ok(answer.id)
    }

    /// The schema `id` when it is cached (asks nobody).
    pub fn cached_schema(&self, id: u32) -> Option<Arc<RegisteredSchema>> {
        read(&self.by_id).get(&id).cloned()
    }

    /// The schema with id `id` (cached forever: an id's schema never changes).
    pub async fn schema(&self, id: u32) -> Result<Arc<RegisteredSchema>, RegistryError> {
        if let Some(found) = self.cached_schema(id) {
            return Ok(found);
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Answer {
            schema: String,
            schema_type: Option<SchemaType>,
        }
        let answer: Answer = self
            .send(
                &format!("fetching schema id {id}"),
                self.http.get(format!("{}/schemas/ids/{id}", self.base)),
            )
            .await?;
        let found = Arc::new(RegisteredSchema {
            id,
            schema_type: answer.schema_type.unwrap_or(SchemaType::Avro),
            schema: answer.schema,
        });
        write(&self.by_id).insert(id, found.clone());
        Ok(found)
    }

    /// The latest version registered under `subject` (not cached: it changes).
    pub async fn latest(&self, subject: &str) -> Result<RegisteredSchema, RegistryError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Answer {
            id: u32,
            schema: String,
            schema_type: Option<SchemaType>,
        }
        let answer: Answer = self
            .send(
                &format!("reading the latest schema of `{subject}`"),
                self.http.get(format!(
                    "{}/subjects/{}/versions/latest",
                    self.base,
                    encode(subject)
                )),
            )
            .await?;
        Ok(RegisteredSchema {
            id: answer.id,
            schema_type: answer.schema_type.unwrap_or(SchemaType::Avro),
            schema: answer.schema,
        })
    }

    /// Whether `schema` is compatible with the latest version under `subject`, at the
    /// compatibility level the registry keeps for the subject (BACKWARD: a reader of
    /// `schema` can read what the latest version wrote). A subject with no versions yet
    /// is compatible.
    pub async fn is_compatible(
        &self,
        subject: &str,
        schema_type: SchemaType,
        schema: &str,
    ) -> Result<bool, RegistryError> {
        #[derive(Deserialize)]
        struct Answer {
            is_compatible: bool,
        }
        let what = format!("checking a schema's compatibility under `{subject}`");
        let request = self
            .http
            .post(format!(
                "{}/compatibility/subjects/{}/versions/latest",
                self.base,
                encode(subject)
            ))
            .json(&SchemaBody {
                schema,
                schema_type,
            });
        match self.send::<Answer>(&what, request).await {
            Ok(answer) => Ok(answer.is_compatible),
            Err(RegistryError::NotFound(_)) => Ok(true),
            Err(e) => Err(e),
        }
    }

    /// Set the compatibility level of `subject` (`BACKWARD`, `FORWARD`, `FULL`, `NONE`,
    /// and their `_TRANSITIVE` forms).
    pub async fn set_compatibility(&self, subject: &str, level: &str) -> Result<(), RegistryError> {
        let _: serde_json::Value = self
            .send(
                &format!("setting the compatibility of `{subject}`"),
                self.http
                    .put(format!("{}/config/{}", self.base, encode(subject)))
                    .json(&serde_json::json!({ "compatibility": level })),
            )
            .await?;
        Ok(())
    }

    async fn send<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        request: reqwest::RequestBuilder,
    ) -> Result<T, RegistryError> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let mut request = request.header(reqwest::header::ACCEPT, CONTENT_TYPE);
        if let Some((user, password)) = &self.credentials {
            request = request.basic_auth(user, Some(password));
        }
        let unavailable = |source: reqwest::Error| {
            // The base URL holds no credentials (they travel as basic authentication),
            // but a request URL is noise in an error that already says what was asked.
            let source = source.without_url();
            RegistryError::Unavailable {
                context: format!("{what}: {source}"),
                source: Some(source),
            }
        };
        let response = request.send().await.map_err(unavailable)?;
        let status = response.status();
        if status.is_success() {
            return response.json().await.map_err(unavailable);
        }
        #[derive(Deserialize, Default)]
        struct Refusal {
            #[serde(default)]
            error_code: i64,
            #[serde(default)]
            message: String,
        }
        let refusal: Refusal = response.json().await.unwrap_or_default();
        if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS {
            return Err(RegistryError::Unavailable {
                context: format!("{what}: HTTP {status}: {}", refusal.message),
                source: None,
            });
        }
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(RegistryError::NotFound(format!(
                "{what}: {} (error {})",
                refusal.message, refusal.error_code
            )));
        }
        Err(RegistryError::Refused {
            what: what.to_owned(),
            status: status.as_u16(),
            code: refusal.error_code,
            message: refusal.message,
        })
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SchemaBody<'a> {
    schema: &'a str,
    schema_type: SchemaType,
}

/// A subject as one URL path segment.
fn encode(subject: &str) -> String {
    let mut url = reqwest::Url::parse("http://x/").expect("a constant URL parses");
    url.path_segments_mut()
        .expect("an http URL has path segments")
        .push(subject);
    url.path().trim_start_matches('/').to_owned()
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_strategies_name_subjects_as_confluent_does() {
        let record = "shop.OrderCreated";
        assert_eq!(
            SubjectStrategy::TopicName.subject("orders", record),
            "orders-value"
        );
        assert_eq!(
            SubjectStrategy::RecordName.subject("orders", record),
            "shop.OrderCreated"
        );
        assert_eq!(
            SubjectStrategy::TopicRecordName.subject("orders", record),
            "orders-shop.OrderCreated"
        );
    }

    #[test]
    fn subjects_are_one_path_segment() {
        assert_eq!(encode("orders-value"), "orders-value");
        assert_eq!(encode("a/b c"), "a%2Fb%20c");
    }

    #[test]
    fn credentials_in_the_url_become_basic_auth_and_never_show() {
        let registry =
            SchemaRegistry::new("https://key:s3cr%40t@registry.example:8081/apis/ccompat/v7/")
                .unwrap();
        assert_eq!(
            registry.credentials,
            Some(("key".to_owned(), "s3cr@t".to_owned()))
        );
        assert_eq!(
            registry.base,
            "https://registry.example:8081/apis/ccompat/v7"
        );
        let debug = format!("{registry:?}");
        assert!(
            !debug.contains("s3cr") && !debug.contains("key:"),
            "{debug}"
        );
        let err = SchemaRegistry::new("ftp://key:s3cret@registry.example").unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert!(
            err.to_string().contains("key:***@registry.example"),
            "{err}"
        );
    }

    #[test]
    fn a_url_that_is_not_http_is_refused_naming_it() {
        let err = SchemaRegistry::new("kafka://127.0.0.1:9092").unwrap_err();
        assert!(err.to_string().contains("kafka://127.0.0.1:9092"), "{err}");
    }
}

//! The secured Kafka node `scripts/brokers secure up` starts (TLS, SASL, ACLs enforced):
//! its URLs, its test PKI, granting ACLs from the `kafka-acls.sh` lines
//! `reliq topology permissions` prints (parsed and created in one admin request), and a
//! conformance factory whose consumers hold only those grants.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::kafka::KafkaBackend;
use anyhow::{Context as _, bail};
use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Access, Broker, Permissions, Subscription};
use reliq_kafka::KafkaBroker;

use crate::settings;

/// `<repo>/.brokers/secure/pki` (or under `BROKERS_DIR`): the CA and the certificates.
pub fn pki() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::var_os("BROKERS_DIR")
        .map(PathBuf::from)
        .map_or_else(
            || root.join(".brokers"),
            |d| if d.is_absolute() { d } else { root.join(d) },
        );
    dir.join("secure").join("pki")
}

/// A file of the test PKI, as a URL value.
pub fn pki_file(name: &str) -> String {
    pki().join(name).to_string_lossy().into_owned()
}

fn port(key: &str) -> String {
    settings::get(key)
}

use crate::kafka::TEST_PARAMS;

/// SASL_SSL with SCRAM-SHA-512 as `user`, trusting the test CA.
pub fn scram_url(user: &str, password: &str) -> String {
    format!(
        "kafka://127.0.0.1:{}?security.protocol=sasl_ssl&sasl.mechanism=SCRAM-SHA-512\
         &sasl.username={user}&sasl.password={password}&ssl.ca.location={}&{TEST_PARAMS}",
        port("KAFKA_SECURE_SASL_SSL_PORT"),
        pki_file("ca.crt"),
    )
}

/// Mutual TLS with the certificate `cert` (`<cert>.crt` / `<cert>.key` in the PKI),
/// trusting `ca` (`ca.crt` normally).
pub fn mtls_url(cert: &str, ca: &str) -> String {
    format!(
        "kafka://127.0.0.1:{}?security.protocol=ssl&ssl.ca.location={}\
         &ssl.certificate.location={}&ssl.key.location={}&{TEST_PARAMS}",
        port("KAFKA_SECURE_MTLS_PORT"),
        pki_file(&format!("{ca}.crt")),
        pki_file(&format!("{cert}.crt")),
        pki_file(&format!("{cert}.key")),
    )
}

/// `<repo>/.brokers/secure/nats-auth/NAME`: the NATS credentials file and nkeys.
pub fn nats_auth_file(name: &str) -> String {
    pki()
        .with_file_name("nats-auth")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// A secured NATS server (`users`, `mtls`, `jwt`: its port key in brokers.env) with the
/// query `auth` (the way of signing in), trusting the test CA.
pub fn nats_url(server: &str, auth: &str) -> String {
    let key = format!("NATS_SECURE_{}_PORT", server.to_ascii_uppercase());
    format!(
        "tls://127.0.0.1:{}?tls.ca={}{}{auth}",
        port(&key),
        pki_file("ca.crt"),
        if auth.is_empty() { "" } else { "&" },
    )
}

/// The super user `admin` (SCRAM over TLS): creates topics, grants ACLs.
pub fn admin_url() -> String {
    scram_url("admin", &settings::get("KAFKA_SECURE_ADMIN_PASSWORD"))
}

/// One ACL as a printed `kafka-acls.sh` line states it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AclLine {
    /// `--allow-principal`.
    pub principal: String,
    /// `--operation`s.
    pub operations: Vec<String>,
    /// `topic` or `group`.
    pub resource: String,
    /// The resource's name or prefix.
    pub name: String,
    /// `--resource-pattern-type prefixed`.
    pub prefixed: bool,
}

/// The `kafka-acls.sh … --add` lines of a permissions document, parsed; a line this
/// cannot read is an error (the document is meant to be applied as printed).
pub fn acl_lines(document: &str) -> anyhow::Result<Vec<AclLine>> {
    let mut out = Vec::new();
    for line in document.lines().filter(|l| l.starts_with("kafka-acls.sh ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let value = |flag: &str| {
            words
                .iter()
                .position(|w| *w == flag)
                .and_then(|i| words.get(i + 1))
                .map(|v| (*v).to_owned())
        };
        let (resource, name) = ["topic", "group", "cluster", "transactional-id"]
            .iter()
            .find_map(|r| value(&format!("--{r}")).map(|n| ((*r).to_owned(), n)))
            .with_context(|| format!("no resource in `{line}`"))?;
        if !words.contains(&"--add") {
            bail!("not an --add line: `{line}`");
        }
        out.push(AclLine {
            principal: value("--allow-principal")
                .with_context(|| format!("no principal in `{line}`"))?,
            operations: words
                .windows(2)
                .filter(|w| w[0] == "--operation")
                .map(|w| w[1].to_owned())
                .collect(),
            resource,
            name,
            prefixed: value("--resource-pattern-type").as_deref() == Some("prefixed"),
        });
    }
    Ok(out)
}

/// Create the ACLs of a permissions document on the secured node, as its super user, in
/// one `CreateAcls` request (librdkafka's admin API: rdkafka has no wrapper for it).
pub async fn apply(document: &str) -> anyhow::Result<()> {
    let lines = acl_lines(document)?;
    if lines.is_empty() {
        bail!("no kafka-acls.sh line in:\n{document}");
    }
    tokio::task::spawn_blocking(move || create_acls(&lines)).await?
}

fn create_acls(lines: &[AclLine]) -> anyhow::Result<()> {
    use std::ffi::{CStr, CString};

    use rdkafka::bindings as rd;
    use rdkafka::producer::{BaseProducer, Producer as _};

    let mut config = rdkafka::ClientConfig::new();
    for (k, v) in [
        (
            "bootstrap.servers",
            format!("127.0.0.1:{}", port("KAFKA_SECURE_SASL_SSL_PORT")),
        ),
        ("security.protocol", "sasl_ssl".into()),
        ("sasl.mechanism", "SCRAM-SHA-512".into()),
        ("sasl.username", "admin".into()),
        (
            "sasl.password",
            settings::get("KAFKA_SECURE_ADMIN_PASSWORD"),
        ),
        ("ssl.ca.location", pki_file("ca.crt")),
    ] {
        config.set(k, v);
    }
    let client: BaseProducer = config.create()?;
    let operation = |op: &str| -> anyhow::Result<rd::rd_kafka_AclOperation_t> {
        use rd::rd_kafka_AclOperation_t::*;
        Ok(match op {
            "Read" => RD_KAFKA_ACL_OPERATION_READ,
            "Write" => RD_KAFKA_ACL_OPERATION_WRITE,
            "Create" => RD_KAFKA_ACL_OPERATION_CREATE,
            "Delete" => RD_KAFKA_ACL_OPERATION_DELETE,
            "Alter" => RD_KAFKA_ACL_OPERATION_ALTER,
            "Describe" => RD_KAFKA_ACL_OPERATION_DESCRIBE,
            "DescribeConfigs" => RD_KAFKA_ACL_OPERATION_DESCRIBE_CONFIGS,
            "AlterConfigs" => RD_KAFKA_ACL_OPERATION_ALTER_CONFIGS,
            "IdempotentWrite" => RD_KAFKA_ACL_OPERATION_IDEMPOTENT_WRITE,
            other => bail!("unknown operation {other}"),
        })
    };
    let mut bindings = Vec::new();
    let mut errstr = [0 as std::ffi::c_char; 512];
    for line in lines {
        let restype = match line.resource.as_str() {
            "topic" => rd::rd_kafka_ResourceType_t::RD_KAFKA_RESOURCE_TOPIC,
            "group" => rd::rd_kafka_ResourceType_t::RD_KAFKA_RESOURCE_GROUP,
            "cluster" => rd::rd_kafka_ResourceType_t::RD_KAFKA_RESOURCE_BROKER,
            other => bail!("resource {other} is not applied by the tests"),
        };
        let pattern = if line.prefixed {
            rd::rd_kafka_ResourcePatternType_t::RD_KAFKA_RESOURCE_PATTERN_PREFIXED
        } else {
            rd::rd_kafka_ResourcePatternType_t::RD_KAFKA_RESOURCE_PATTERN_LITERAL
        };
        let name = CString::new(line.name.as_str())?;
        let principal = CString::new(line.principal.as_str())?;
        let host = CString::new("*")?;
        for op in &line.operations {
            // SAFETY: every pointer is a live NUL-terminated string or the error buffer
            // with its length; the binding is freed below.
            let binding = unsafe {
                rd::rd_kafka_AclBinding_new(
                    restype,
                    name.as_ptr(),
                    pattern,
                    principal.as_ptr(),
                    host.as_ptr(),
                    operation(op)?,
                    rd::rd_kafka_AclPermissionType_t::RD_KAFKA_ACL_PERMISSION_TYPE_ALLOW,
                    errstr.as_mut_ptr(),
                    errstr.len(),
                )
            };
            if binding.is_null() {
                // SAFETY: librdkafka wrote a NUL-terminated message into the buffer.
                let why = unsafe { CStr::from_ptr(errstr.as_ptr()) }.to_string_lossy();
                bail!("ACL binding for {line:?}: {why}");
            }
            bindings.push(binding);
        }
    }
    let rk = client.client().native_ptr();
    // SAFETY: `rk` lives as long as `client`; the queue and the event are destroyed here;
    // the bindings are copied by CreateAcls and freed after it.
    unsafe {
        let queue = rd::rd_kafka_queue_new(rk);
        rd::rd_kafka_CreateAcls(
            rk,
            bindings.as_mut_ptr(),
            bindings.len(),
            std::ptr::null(),
            queue,
        );
        rd::rd_kafka_AclBinding_destroy_array(bindings.as_mut_ptr(), bindings.len());
        let event = rd::rd_kafka_queue_poll(queue, 30_000);
        let outcome = if event.is_null() {
            Err(anyhow::anyhow!("CreateAcls: no answer within 30 s"))
        } else if rd::rd_kafka_event_error(event)
            != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        {
            Err(anyhow::anyhow!(
                "CreateAcls: {}",
                CStr::from_ptr(rd::rd_kafka_event_error_string(event)).to_string_lossy()
            ))
        } else {
            let result = rd::rd_kafka_event_CreateAcls_result(event);
            let mut count = 0usize;
            let results = rd::rd_kafka_CreateAcls_result_acls(result, &mut count);
            let mut failures = Vec::new();
            for i in 0..count {
                let error = rd::rd_kafka_acl_result_error(*results.add(i));
                if !error.is_null() {
                    failures.push(
                        CStr::from_ptr(rd::rd_kafka_error_string(error))
                            .to_string_lossy()
                            .into_owned(),
                    );
                }
            }
            if failures.is_empty() {
                Ok(())
            } else {
                Err(anyhow::anyhow!("CreateAcls: {}", failures.join("; ")))
            }
        };
        if !event.is_null() {
            rd::rd_kafka_event_destroy(event);
        }
        rd::rd_kafka_queue_destroy(queue);
        outcome
    }
}

/// Which printed `kafka-acls.sh` lines a [`SecuredKafkaBackend`] applies (all but one:
/// to show that a missing grant fails, naming its resource).
pub type GrantFilter = fn(&str) -> bool;

/// The conformance factory on the secured node: consumers and publishes run as
/// `principal`, holding only what `reliq topology permissions` prints for the scenario's
/// consumers (`consumers`: their names), the operator's part included (the dead-letter
/// reader scenarios) and publishing to the source; the super user declares the source and
/// breaks routes for the fault scenarios (the plain node's [`KafkaBackend`] otherwise).
pub struct SecuredKafkaBackend {
    kafka: KafkaBackend,
    principal: String,
    consumers: &'static [&'static str],
    keep: GrantFilter,
}

impl SecuredKafkaBackend {
    /// SCRAM-SHA-512 over TLS as the test's SCRAM user.
    pub fn scram(consumers: &'static [&'static str]) -> Self {
        let user = settings::get("KAFKA_SECURE_SCRAM_USER");
        let url = scram_url(&user, &settings::get("KAFKA_SECURE_SCRAM_PASSWORD"));
        Self::new(&url, format!("User:{user}"), consumers)
    }

    /// Mutual TLS with the test's client certificate (principal = its CN).
    pub fn mtls(consumers: &'static [&'static str]) -> Self {
        let user = settings::get("KAFKA_SECURE_MTLS_USER");
        Self::new(&mtls_url(&user, "ca"), format!("User:{user}"), consumers)
    }

    fn new(url: &str, principal: String, consumers: &'static [&'static str]) -> Self {
        Self {
            kafka: KafkaBackend::on(&admin_url(), Some(url)),
            principal,
            consumers,
            keep: |_| true,
        }
    }

    /// Apply only the printed ACL lines `keep` accepts.
    #[must_use]
    pub fn keeping(mut self, keep: GrantFilter) -> Self {
        self.keep = keep;
        self
    }

    /// What this backend grants for `topic`: the permissions printed for its consumers,
    /// the document without the lines its filter leaves out.
    pub async fn permissions_for(
        &self,
        broker: &Arc<dyn Broker>,
        topic: &str,
    ) -> anyhow::Result<Permissions> {
        let subs: Vec<Subscription> = self
            .consumers
            .iter()
            .map(|name| {
                reliq_conformance::support::test_consumer(self, broker.clone(), topic, name)
                    .subscription()
                    .map_err(anyhow::Error::from)
            })
            .collect::<anyhow::Result<_>>()?;
        let access = Access {
            consumers: subs,
            publishes: vec![topic.to_owned()],
            principal: Some(self.principal.clone()),
            operator: true,
        };
        let mut permissions = broker.permissions(&access).await?;
        let keep = self.keep;
        permissions.document = permissions
            .document
            .lines()
            .filter(|l| !l.starts_with("kafka-acls.sh ") || keep(l))
            .map(|l| format!("{l}\n"))
            .collect();
        Ok(permissions)
    }
}

#[async_trait]
impl Backend for SecuredKafkaBackend {
    fn name(&self) -> &'static str {
        self.kafka.name()
    }

    /// Grant before the first connection, as a deployment does: an idempotent producer
    /// that starts before its principal may write anywhere is refused its producer id and
    /// fails for good. Then wait until the node's authorizer holds the grants.
    async fn prepare(&self, topic: &str) -> anyhow::Result<()> {
        let admin: Arc<dyn Broker> = Arc::new(self.kafka.admin().clone());
        self.kafka.declare_source(&admin, topic).await?;
        let permissions = self.permissions_for(&admin, topic).await?;
        apply(&permissions.document).await?;
        let probe = KafkaBroker::connect(self.kafka.url())?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match probe.topic_exists(topic).await {
                Ok(true) => return Ok(()),
                other if tokio::time::Instant::now() >= deadline => {
                    bail!("the grants on {topic} did not take effect within 30 s: {other:?}")
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>> {
        self.kafka.connect().await
    }

    fn tiers(&self) -> [Duration; 2] {
        self.kafka.tiers()
    }

    fn tolerance(&self) -> Duration {
        self.kafka.tolerance()
    }

    fn quiet_period(&self) -> Duration {
        self.kafka.quiet_period()
    }

    async fn declare_source(&self, broker: &Arc<dyn Broker>, topic: &str) -> anyhow::Result<()> {
        self.kafka.declare_source(broker, topic).await
    }

    async fn set_dead_letter_available(
        &self,
        broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.kafka
            .set_dead_letter_available(broker, sub, available)
            .await
    }

    async fn set_retry_available(
        &self,
        broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.kafka.set_retry_available(broker, sub, available).await
    }

    async fn unsettled(&self, broker: &Arc<dyn Broker>, sub: &Subscription) -> Option<usize> {
        self.kafka.unsettled(broker, sub).await
    }
}

/// The conformance factory on the JWT-authenticated NATS server: each test's consumers run
/// as a user minted for it (`scripts/brokers secure nats-user`) whose JWT allows only the
/// subjects `reliq topology permissions` prints for them (consumer, operator, publishing
/// to the source).
pub struct SecuredNatsBackend {
    consumers: &'static [&'static str],
    /// The plain server's factory: the timings are the same.
    plain: crate::nats::NatsBackend,
    /// Which printed subjects the minted user gets (all but one: to show one is needed).
    keep: fn(&str) -> bool,
    /// The plain backend on the minted user's credentials, once [`Backend::prepare`] ran.
    minted: std::sync::OnceLock<(crate::nats::NatsBackend, tempfile::NamedTempFile)>,
}

impl SecuredNatsBackend {
    /// For the scenario's consumer names.
    pub fn new(consumers: &'static [&'static str]) -> Self {
        Self {
            consumers,
            plain: crate::nats::NatsBackend::new(),
            keep: |_| true,
            minted: std::sync::OnceLock::new(),
        }
    }

    /// Mint the user with only the printed subjects `keep` accepts.
    #[must_use]
    pub fn keeping(mut self, keep: fn(&str) -> bool) -> Self {
        self.keep = keep;
        self
    }

    fn nats(&self) -> &crate::nats::NatsBackend {
        &self
            .minted
            .get()
            .expect("Ctx::new prepares the backend before it connects")
            .0
    }
}

/// `{"publish": [...], "subscribe": [...]}` of a NATS permissions' grants.
pub fn nats_subjects(permissions: &Permissions) -> serde_json::Value {
    let of = |op: &str| -> Vec<&str> {
        permissions
            .grants
            .iter()
            .filter(|g| g.operations.contains(&op))
            .map(|g| g.name.as_str())
            .collect()
    };
    serde_json::json!({ "publish": of("publish"), "subscribe": of("subscribe") })
}

/// The credentials file of a new user of the JWT server allowed only `subjects`.
pub async fn mint_nats_user(
    name: &str,
    subjects: &serde_json::Value,
) -> anyhow::Result<tempfile::NamedTempFile> {
    use tokio::io::AsyncWriteExt as _;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/brokers");
    let mut child = tokio::process::Command::new(script)
        .args(["secure", "nats-user", name])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running scripts/brokers secure nats-user")?;
    let mut stdin = child.stdin.take().context("stdin")?;
    stdin.write_all(subjects.to_string().as_bytes()).await?;
    drop(stdin);
    let out = child.wait_with_output().await?;
    if !out.status.success() {
        bail!("nats-user: {}", String::from_utf8_lossy(&out.stderr));
    }
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), &out.stdout)?;
    Ok(file)
}

#[async_trait]
impl Backend for SecuredNatsBackend {
    fn name(&self) -> &'static str {
        "nats"
    }

    async fn prepare(&self, topic: &str) -> anyhow::Result<()> {
        // The permissions are computed by any connection: they read nothing.
        let full = reliq_nats::NatsBroker::connect(&nats_url(
            "jwt",
            &format!("creds={}", nats_auth_file("reliq.creds")),
        ))
        .await?;
        let [t1, t2] = self.tiers();
        let consumers = self
            .consumers
            .iter()
            .map(|name| {
                let mut sub = Subscription::new(*name, topic);
                sub.retry_tiers = vec![t1, t2];
                sub
            })
            .collect();
        let access = Access {
            consumers,
            publishes: vec![topic.to_owned()],
            principal: Some(topic.to_owned()),
            operator: true,
        };
        let mut permissions = full.permissions(&access).await?;
        let keep = self.keep;
        permissions.grants.retain(|g| keep(&g.name));
        let creds = mint_nats_user(topic, &nats_subjects(&permissions)).await?;
        let url = nats_url("jwt", &format!("creds={}", creds.path().display()));
        if self
            .minted
            .set((crate::nats::NatsBackend::on(url), creds))
            .is_err()
        {
            bail!("one backend per test: already prepared");
        }
        Ok(())
    }

    async fn connect(&self) -> anyhow::Result<Arc<dyn Broker>> {
        self.nats().connect().await
    }

    fn tiers(&self) -> [Duration; 2] {
        self.plain.tiers()
    }

    fn tolerance(&self) -> Duration {
        self.plain.tolerance()
    }

    fn quiet_period(&self) -> Duration {
        self.plain.quiet_period()
    }

    fn crash_lease(&self) -> Duration {
        self.plain.crash_lease()
    }

    async fn declare_source(&self, broker: &Arc<dyn Broker>, topic: &str) -> anyhow::Result<()> {
        self.nats().declare_source(broker, topic).await
    }

    async fn set_dead_letter_available(
        &self,
        broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.nats()
            .set_dead_letter_available(broker, sub, available)
            .await
    }

    async fn set_retry_available(
        &self,
        broker: &Arc<dyn Broker>,
        sub: &Subscription,
        available: bool,
    ) -> anyhow::Result<()> {
        self.nats()
            .set_retry_available(broker, sub, available)
            .await
    }

    async fn unsettled(&self, broker: &Arc<dyn Broker>, sub: &Subscription) -> Option<usize> {
        self.nats().unsettled(broker, sub).await
    }
}

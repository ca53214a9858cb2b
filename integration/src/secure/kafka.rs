//! The secured Kafka node: SCRAM and mutual-TLS URLs, the super user, and granting the
//! `kafka-acls.sh` lines `reliq topology permissions` prints (parsed, and created in one
//! admin request).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use async_trait::async_trait;
use reliq_conformance::Backend;
use reliq_core::{Access, Broker};
use reliq_kafka::KafkaBroker;

use super::{Issuer, Secured, pki_file, port, scenario_subscriptions};
use crate::kafka::{KafkaBackend, TEST_PARAMS};
use crate::settings;

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

/// The region the MSK IAM tests sign for.
pub const MSK_IAM_REGION: &str = "eu-west-1";

/// AWS MSK IAM at the node's MSK IAM stand-in listener, trusting the test CA; the
/// credentials come from the AWS default chain (the tests put the listener's test key in
/// the environment).
pub fn msk_iam_url() -> String {
    format!(
        "kafka://127.0.0.1:{}?sasl.oauthbearer.method=aws_msk_iam&reliq.aws.region={MSK_IAM_REGION}\
         &ssl.ca.location={}&{TEST_PARAMS}",
        port("KAFKA_SECURE_MSK_IAM_PORT"),
        pki_file("ca.crt"),
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

/// The conformance factory on the secured Kafka node: consumers and publishes run as
/// `principal`, holding only what `reliq topology permissions` prints for the scenario's
/// consumers, the operator's part included (the dead-letter reader scenarios) and
/// publishing to the source; the super user declares the source and breaks routes for
/// the fault scenarios.
pub type SecuredKafkaBackend = Secured<KafkaGrants>;

/// Grants the printed ACLs before the test's first connection ([`SecuredKafkaBackend`]).
pub struct KafkaGrants {
    url: String,
    principal: String,
    consumers: &'static [&'static str],
    keep: GrantFilter,
}

impl Secured<KafkaGrants> {
    /// SCRAM-SHA-512 over TLS as the test's SCRAM user.
    pub fn scram(consumers: &'static [&'static str]) -> Self {
        let user = settings::get("KAFKA_SECURE_SCRAM_USER");
        let url = scram_url(&user, &settings::get("KAFKA_SECURE_SCRAM_PASSWORD"));
        Self::kafka(url, format!("User:{user}"), consumers)
    }

    /// Mutual TLS with the test's client certificate (principal = its CN).
    pub fn mtls(consumers: &'static [&'static str]) -> Self {
        let user = settings::get("KAFKA_SECURE_MTLS_USER");
        Self::kafka(mtls_url(&user, "ca"), format!("User:{user}"), consumers)
    }

    fn kafka(url: String, principal: String, consumers: &'static [&'static str]) -> Self {
        let grants = KafkaGrants {
            url,
            principal,
            consumers,
            keep: |_| true,
        };
        Self::with(grants, KafkaBackend::new())
    }

    /// Apply only the printed ACL lines `keep` accepts.
    #[must_use]
    pub fn keeping(mut self, keep: GrantFilter) -> Self {
        self.issuer.keep = keep;
        self
    }
}

#[async_trait]
impl Issuer for KafkaGrants {
    fn name(&self) -> &'static str {
        "kafka"
    }

    /// Grant before the first connection, as a deployment does: an idempotent producer
    /// that starts before its principal may write anywhere is refused its producer id and
    /// fails for good. Then wait until the node's authorizer holds the grants.
    async fn issue(&self, timings: &dyn Backend, topic: &str) -> anyhow::Result<Box<dyn Backend>> {
        let kafka = KafkaBackend::on(&admin_url(), Some(&self.url));
        let admin: Arc<dyn Broker> = Arc::new(kafka.admin().clone());
        kafka.declare_source(&admin, topic).await?;
        let access = Access {
            consumers: scenario_subscriptions(timings, &admin, topic, self.consumers)?,
            publishes: vec![topic.to_owned()],
            principal: Some(self.principal.clone()),
            operator: true,
        };
        let permissions = admin.permissions(&access).await?;
        let keep = self.keep;
        let document: String = permissions
            .document
            .lines()
            .filter(|l| !l.starts_with("kafka-acls.sh ") || keep(l))
            .map(|l| format!("{l}\n"))
            .collect();
        apply(&document).await?;
        let probe = KafkaBroker::connect(kafka.url())?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match probe.topic_exists(topic).await {
                Ok(true) => return Ok(Box::new(kafka)),
                other if tokio::time::Instant::now() >= deadline => {
                    bail!("the grants on {topic} did not take effect within 30 s: {other:?}")
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

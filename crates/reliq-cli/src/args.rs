//! The command line.

use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};
use reliq_admin::FilterSpec;

use crate::Failure;

/// reliq: a consumer's dead letters on Kafka, RabbitMQ, NATS JetStream, SQS or the
/// embedded broker — look, replay, correct, purge — and the admin API.
///
/// Exit codes: 0 done; 1 failed (broker, file); 2 bad usage or input; 3 incomplete (a
/// replay or purge left matching entries, or was interrupted); 4 no such entry; 5 the
/// broker's topology differs from the plan (`topology check`).
#[derive(Debug, Parser)]
#[command(name = "reliq", version)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// More detail on stderr: `-v` every log line as it comes (a client library's
    /// repeated connection errors are otherwise folded into one line per cause) at the
    /// info level, `-vv` at the debug level. `RUST_LOG` overrides the level.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub(crate) verbose: u8,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// A consumer's dead-letter queue.
    Dlq {
        #[command(subcommand)]
        command: Box<DlqCommand>,
    },
    /// The broker objects a consumer needs, and whether the broker has them as planned.
    Topology {
        #[command(subcommand)]
        command: TopologyCommand,
    },
    /// The consumer's AsyncAPI 3.0 document on stdout: the channel it reads, its retry
    /// channels, its dead-letter channel with reliq's dead-letter record, the replay, and
    /// the broker's bindings — from the same settings as `topology plan` (creates nothing).
    Asyncapi(Box<AsyncapiArgs>),
    /// The admin HTTP API.
    Admin {
        #[command(subcommand)]
        command: AdminCommand,
    },
}

/// Which broker.
#[derive(Debug, Args)]
pub(crate) struct BrokerArgs {
    /// Broker URL: kafka://…, amqp://…, nats://…, sqs://…, memory://.
    #[arg(long, env = "RELIQ_URL")]
    pub(crate) url: Option<String>,
    /// Instead of --url: a file holding the URL (one line), so that a URL with a
    /// password never shows in the process list (e.g. a mounted secret).
    #[arg(long, env = "RELIQ_URL_FILE", conflicts_with = "url")]
    pub(crate) url_file: Option<PathBuf>,
    /// Instead of --url: a backend name (kafka, rabbit, nats, sqs) whose URL is
    /// `RELIQ_<NAME>_URL` from the environment or ./brokers.env.
    #[arg(long, env = "RELIQ_BACKEND", conflicts_with_all = ["url", "url_file"])]
    pub(crate) backend: Option<String>,
    /// How long to try to reach the broker before giving up (exit 1 naming the URL).
    #[arg(long, env = "RELIQ_CONNECT_TIMEOUT", default_value = "10s")]
    pub(crate) connect_timeout: humantime::Duration,
}

impl BrokerArgs {
    /// The URL to connect to.
    pub(crate) fn url(&self) -> Result<String, Failure> {
        if let Some(url) = &self.url {
            return Ok(url.clone());
        }
        if let Some(path) = &self.url_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| crate::bad_input(format!("--url-file {}: {e}", path.display())))?;
            let url = text.trim();
            if url.is_empty() {
                return Err(crate::bad_input(format!(
                    "--url-file {}: the file is empty",
                    path.display()
                )));
            }
            return Ok(url.to_owned());
        }
        let Some(backend) = &self.backend else {
            return Err(crate::bad_input(
                "which broker? pass --url (or RELIQ_URL), --url-file, or --backend kafka|rabbit|nats|sqs",
            ));
        };
        let key = format!("RELIQ_{}_URL", backend.to_ascii_uppercase());
        if let Ok(url) = std::env::var(&key)
            && !url.is_empty()
        {
            return Ok(url);
        }
        brokers_env_value(Path::new("."), &key).ok_or_else(|| {
            crate::bad_input(format!(
                "--backend {backend}: `{key}` is neither set nor in a brokers.env here or above"
            ))
        })
    }
}

/// `key`'s value in the first brokers.env found from `dir` upwards.
fn brokers_env_value(dir: &Path, key: &str) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    dir.ancestors().find_map(|d| {
        let text = std::fs::read_to_string(d.join("brokers.env")).ok()?;
        text.lines()
            .map(str::trim)
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .find(|(k, _)| k.trim() == key)
            .map(|(_, v)| v.trim().to_owned())
    })
}

/// Which consumer's DLQ, and how to answer.
#[derive(Debug, Args)]
pub(crate) struct Target {
    #[command(flatten)]
    pub(crate) broker: BrokerArgs,
    /// The consumer (group) whose DLQ it is.
    #[arg(long, env = "RELIQ_CONSUMER")]
    pub(crate) consumer: String,
    /// What the consumer consumes: topic, exchange, stream or queue.
    #[arg(long, env = "RELIQ_SOURCE")]
    pub(crate) source: String,
    /// One JSON document on stdout instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Which dead letters (every flag given must hold).
#[derive(Debug, Args)]
pub(crate) struct FilterArgs {
    /// Dead-letter reason: exhausted, permanent, poison, expired, max-deliveries, panic.
    #[arg(long, value_delimiter = ',')]
    pub(crate) reason: Vec<String>,
    /// Error class: transient, permanent, poison, panic.
    #[arg(long, value_delimiter = ',')]
    pub(crate) class: Vec<String>,
    /// Error fingerprint id, as `stats` prints it.
    #[arg(long, value_delimiter = ',')]
    pub(crate) fingerprint: Vec<String>,
    /// Message id.
    #[arg(long, value_delimiter = ',')]
    pub(crate) id: Vec<String>,
    /// A header, name=value (repeat for several; all must match).
    #[arg(long)]
    pub(crate) header: Vec<String>,
    /// A substring of the payload.
    #[arg(long)]
    pub(crate) payload_contains: Option<String>,
    /// Dead-lettered at or after: RFC 3339, or an age (2h, 30m).
    #[arg(long)]
    pub(crate) since: Option<String>,
    /// Dead-lettered before: RFC 3339, or an age.
    #[arg(long)]
    pub(crate) until: Option<String>,
    /// At most this many.
    #[arg(long)]
    pub(crate) limit: Option<usize>,
}

impl FilterArgs {
    pub(crate) fn spec(&self) -> FilterSpec {
        FilterSpec {
            reason: self.reason.clone(),
            class: self.class.clone(),
            fingerprint: self.fingerprint.clone(),
            id: self.id.clone(),
            header: self.header.clone(),
            payload_contains: self.payload_contains.clone(),
            since: self.since.clone(),
            until: self.until.clone(),
            limit: self.limit,
        }
    }
}

/// Where replayed messages go.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum ReplayTo {
    /// Only the consumer that dead-lettered them.
    Consumer,
    /// The original destination: every consumer of it.
    Original,
}

impl ReplayTo {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Consumer => "consumer",
            Self::Original => "original",
        }
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum DlqCommand {
    /// Count, oldest age, and groups by reason, class and error fingerprint.
    Stats {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: FilterArgs,
        /// The triage store (the admin server's `--triage-db`): each group's status and
        /// assignee, and archived groups left out.
        #[arg(long, env = "RELIQ_TRIAGE_DB")]
        triage_db: Option<PathBuf>,
        /// With --triage-db: show archived groups too.
        #[arg(long, requires = "triage_db")]
        archived: bool,
    },
    /// A failure group's triage: show it, or set its status or assignee and add a note.
    Triage {
        #[command(flatten)]
        target: Target,
        /// The group's fingerprint id, as `stats` prints it.
        fingerprint: String,
        /// new, investigating, resolved or archived.
        #[arg(long)]
        status: Option<String>,
        /// Who has it (an empty value: nobody).
        #[arg(long)]
        assignee: Option<String>,
        /// A note to add.
        #[arg(long)]
        note: Option<String>,
        /// The triage store (the admin server's `--triage-db`; the file may be shared
        /// with a running server).
        #[arg(long, env = "RELIQ_TRIAGE_DB")]
        triage_db: PathBuf,
        /// Append the change's audit record to this file (the admin server's audit log).
        #[arg(long, env = "RELIQ_ADMIN_AUDIT_LOG")]
        audit_log: Option<PathBuf>,
        /// Whose change it is.
        #[arg(long, env = "USER", default_value = "reliq")]
        by: String,
    },
    /// List entries (changes nothing); --cursor goes on where the last page ended.
    Ls {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: FilterArgs,
        /// Where to start (the `next cursor` a previous ls printed).
        #[arg(long)]
        cursor: Option<String>,
        /// Most entries to list (1 to 1000).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=1000))]
        max: u64,
    },
    /// One entry in full: record, headers, payload.
    Show {
        #[command(flatten)]
        target: Target,
        /// The message id.
        id: String,
        /// A schema registry (Confluent-compatible API): a payload in its wire format is
        /// also shown decoded with its writer's schema (Avro, JSON Schema, Protobuf).
        #[arg(long, env = "RELIQ_SCHEMA_REGISTRY_URL")]
        schema_registry: Option<String>,
    },
    /// Replay matching entries to the consumer; each is removed from the DLQ only after
    /// its copy is confirmed.
    Replay {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: FilterArgs,
        /// Print what would go; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// At most this many messages per second.
        #[arg(long)]
        rate: Option<u32>,
        /// Start at this many per second and raise the rate evenly to --rate over
        /// --ramp (after a fix: the downstream takes the backlog slowly first).
        #[arg(long, requires_all = ["rate", "ramp"])]
        rate_start: Option<u32>,
        /// How long the rise from --rate-start to --rate takes (5m, 30s).
        #[arg(long, requires = "rate_start")]
        ramp: Option<humantime::Duration>,
        /// The consumer's Prometheus metrics (http://host:port/metrics): the replay
        /// stops (exit 3, the rest left in the DLQ) when the consumer's failure share
        /// rises over --max-failure-share.
        #[arg(long)]
        guard_metrics: Option<String>,
        /// The share of received messages the consumer may fail (retried or
        /// dead-lettered) between two checks before the replay stops.
        #[arg(long, default_value_t = 0.05, requires = "guard_metrics")]
        max_failure_share: f64,
        /// How often the consumer's metrics are read.
        #[arg(long, default_value = "5s", requires = "guard_metrics")]
        guard_every: humantime::Duration,
        /// The fewest received messages a share is judged on (fewer: carried into the
        /// next window).
        #[arg(long, default_value_t = 20, requires = "guard_metrics")]
        guard_min_sample: u64,
        /// Where copies go.
        #[arg(long = "target", value_enum, default_value = "consumer")]
        to: ReplayTo,
    },
    /// Replay a corrected copy of one entry (a new id whose causation id is the
    /// original's); the original is removed once the copy is confirmed.
    Edit {
        #[command(flatten)]
        target: Target,
        /// The message id.
        id: String,
        /// The corrected payload.
        #[arg(long)]
        payload_file: Option<PathBuf>,
        /// Instead of --payload-file: the corrected value as JSON, written with the schema
        /// the dead letter's registry-framed payload names (same schema id and, for
        /// Protobuf, message). Needs --schema-registry.
        #[arg(long, conflicts_with = "payload_file", requires = "schema_registry")]
        value_file: Option<PathBuf>,
        /// A header to set on the copy, name=value (repeat for several).
        #[arg(long)]
        header: Vec<String>,
        /// The schema registry (Confluent-compatible API) --value-file is encoded with.
        #[arg(long, env = "RELIQ_SCHEMA_REGISTRY_URL")]
        schema_registry: Option<String>,
    },
    /// Remove matching entries for good.
    Purge {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: FilterArgs,
        /// Print what would go; remove nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask (needed when not at a terminal).
        #[arg(long)]
        yes: bool,
    },
}

/// A consumer's subscription, as its `ConsumerBuilder` makes it (see
/// `ConsumerBuilder::subscription`): the plan depends on every setting here.
#[derive(Debug, Args)]
pub(crate) struct SubscriptionArgs {
    #[command(flatten)]
    pub(crate) target: Target,
    /// The consumer's filter (routing-key pattern or subject), if any.
    #[arg(long)]
    pub(crate) filter: Option<String>,
    /// The retry policy's delay tiers (1s,30s,5m): Kafka retry topics, RabbitMQ TTL queues.
    #[arg(long, value_delimiter = ',', value_parser = humantime::parse_duration)]
    pub(crate) retry_tiers: Vec<std::time::Duration>,
    /// The broker-side delivery limit (a consumer's default: its policy's attempts + 5).
    #[arg(long, default_value_t = 20)]
    pub(crate) delivery_limit: u32,
    /// The lease (ack wait, visibility timeout).
    #[arg(long, default_value = "30s")]
    pub(crate) lease: humantime::Duration,
    /// The consumer's in-flight bound (its prefetch).
    #[arg(long, default_value_t = 64)]
    pub(crate) prefetch: u32,
}

impl SubscriptionArgs {
    pub(crate) fn subscription(&self) -> reliq::Subscription {
        let mut sub =
            reliq::Subscription::new(self.target.consumer.clone(), self.target.source.clone());
        sub.filter = self.filter.clone();
        sub.retry_tiers = self.retry_tiers.clone();
        sub.delivery_limit = self.delivery_limit;
        sub.lease = *self.lease;
        sub.prefetch = self.prefetch;
        sub
    }
}

/// `reliq asyncapi`.
#[derive(Debug, Args)]
pub(crate) struct AsyncapiArgs {
    #[command(flatten)]
    pub(crate) subscription: SubscriptionArgs,
    /// The service's name (the document's title; default: the consumer's).
    #[arg(long)]
    pub(crate) title: Option<String>,
    /// The service's version (the document's `info.version`).
    #[arg(long, default_value = "1.0.0")]
    pub(crate) service_version: String,
    /// The payload's schema: a JSON Schema or Avro schema (JSON), or a `.proto` file.
    /// Without it the payload is described as bytes.
    #[arg(long)]
    pub(crate) payload_schema: Option<PathBuf>,
    /// The schema's language (default: by the file's extension — .avsc avro, .proto
    /// protobuf, else json-schema).
    #[arg(long, value_enum, requires = "payload_schema")]
    pub(crate) payload_format: Option<PayloadFormat>,
    /// The message's name (default: the schema's `title` or `name`, else `Message`).
    #[arg(long, requires = "payload_schema")]
    pub(crate) payload_name: Option<String>,
    /// Leave the broker URL's hosts out of `servers` (a document for every environment).
    #[arg(long)]
    pub(crate) no_servers: bool,
}

/// A payload schema's language.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum PayloadFormat {
    /// JSON Schema (draft-07).
    JsonSchema,
    /// An Avro schema (JSON).
    Avro,
    /// A Protobuf (proto3) file.
    Protobuf,
}

/// Which differences fail `topology check`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum FailOn {
    /// Only what breaks delivery guarantees.
    Breaking,
    /// Any difference.
    Any,
}

#[derive(Debug, Subcommand)]
pub(crate) enum TopologyCommand {
    /// What the consumer needs: objects and settings (changes nothing).
    Plan {
        #[command(flatten)]
        subscription: SubscriptionArgs,
    },
    /// The plan against the live broker: each difference named, with its severity;
    /// exit 5 when one fails the check (changes nothing).
    Check {
        #[command(flatten)]
        subscription: SubscriptionArgs,
        /// Exit 5 on a breaking difference (default) or on any.
        #[arg(long, value_enum, default_value = "breaking")]
        fail_on: FailOn,
    },
    /// What the consumer's credentials must allow (Kafka ACLs as `kafka-acls.sh`
    /// commands), from the same names as the plan; reads nothing from the broker.
    Permissions {
        #[command(flatten)]
        subscription: SubscriptionArgs,
        /// The principal to grant to, in the broker's form (Kafka: `User:orders-svc`).
        #[arg(long)]
        principal: Option<String>,
        /// A topic the service also publishes to (repeat for several).
        #[arg(long)]
        publish: Vec<String>,
        /// Also what the operator's tools need: `reliq dlq` (look, replay, edit, purge),
        /// `reliq topology check`, the admin server.
        #[arg(long)]
        operator: bool,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum AdminCommand {
    /// Serve the admin HTTP API and console. Settings come from the flags, then the
    /// environment, then `--config`, then the defaults shown. Stops on SIGTERM or Ctrl-C:
    /// readiness turns 503, running jobs finish or are handed back, then the listener
    /// closes.
    Serve(Box<ServeArgs>),
    /// Make a token: prints it once, and the entry for the tokens file (its hash).
    Token {
        /// Who it is for (written to the audit log).
        #[arg(long)]
        name: String,
        /// reader (look), operator (+ replay, edit), admin (+ purge).
        #[arg(long)]
        role: String,
        /// Valid for this long (90d, 12h); no expiry when absent.
        #[arg(long)]
        expires_in: Option<humantime::Duration>,
        /// One JSON document on stdout.
        #[arg(long)]
        json: bool,
    },
}

#[cfg(test)]
mod guide_commands {
    //! Every `reliq …` command the guide shows (README.md, docs/*.md, in sh/bash blocks)
    //! parses with this command line, flags and values included: the guide cannot show
    //! a flag that was renamed or removed.

    use std::path::Path;

    use clap::Parser;

    use super::Cli;

    /// The `reliq …` commands of the shell blocks of one Markdown file: their line and
    /// their words, split as a shell does (quotes kept together, a `# comment` dropped,
    /// a `&&` / `||` / `;` / `|` chain cut into its commands).
    fn reliq_commands(text: &str) -> Vec<(usize, Vec<String>)> {
        let mut out = Vec::new();
        let (mut in_shell, mut pending, mut start) = (false, String::new(), 0);
        for (n, line) in text.lines().enumerate() {
            let trimmed = line.trim();
            if let Some(lang) = trimmed.strip_prefix("```") {
                in_shell = !in_shell && matches!(lang, "sh" | "bash" | "shell");
                continue;
            }
            if !in_shell {
                continue;
            }
            if pending.is_empty() {
                start = n + 1;
            }
            if let Some(head) = trimmed.strip_suffix('\\') {
                pending.push_str(head);
                pending.push(' ');
                continue;
            }
            pending.push_str(trimmed);
            let full = std::mem::take(&mut pending);
            let code = full.split(" # ").next().unwrap_or_default();
            let words = shlex::split(code).unwrap_or_else(|| panic!("unbalanced quotes: {code}"));
            for command in words.split(|w| matches!(w.as_str(), "&&" | "||" | ";" | "|")) {
                if command.first().is_some_and(|w| w == "reliq") {
                    out.push((start, command.to_vec()));
                }
            }
        }
        out
    }

    #[test]
    fn every_reliq_command_in_the_guide_parses() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files = vec![root.join("README.md")];
        let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
            .expect("docs/")
            .map(|e| e.expect("docs entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        docs.sort();
        files.extend(docs);
        let (mut checked, mut refused) = (0, Vec::new());
        for file in &files {
            let text = std::fs::read_to_string(file).expect("a guide page");
            for (line, words) in reliq_commands(&text) {
                checked += 1;
                if let Err(e) = Cli::try_parse_from(&words) {
                    refused.push(format!(
                        "{}:{line}: {}\n{e}",
                        file.display(),
                        words.join(" ")
                    ));
                }
            }
        }
        assert!(refused.is_empty(), "{}", refused.join("\n"));
        // The guide shows the plan, check, permissions, dlq and admin commands: finding
        // fewer means the extraction broke, not that the guide is right.
        assert!(
            checked >= 10,
            "only {checked} reliq commands found in the guide"
        );
    }
}

/// `reliq admin serve`: every setting optional here, so that a config file can give it
/// (see `serve.rs` for the file and the defaults).
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// A TOML file with any of these settings (keys as the flags, with `_` for `-`:
    /// `listen`, `tokens`, `consumers = ["billing=orders@1s,30s"]`, `[tls] cert/key`…).
    #[arg(long, env = "RELIQ_ADMIN_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) broker: BrokerArgs,
    /// Address to listen on (port 0: any free port, printed on start) [default:
    /// 127.0.0.1:8080].
    #[arg(long, env = "RELIQ_ADMIN_LISTEN")]
    pub(crate) listen: Option<String>,
    /// The tokens file (see `reliq admin token`); read again when it changes.
    #[arg(long, env = "RELIQ_ADMIN_TOKENS")]
    pub(crate) tokens: Option<PathBuf>,
    /// Append every request's audit record to this file (JSON lines).
    #[arg(long, env = "RELIQ_ADMIN_AUDIT_LOG")]
    pub(crate) audit_log: Option<PathBuf>,
    /// Keep operators' triage of failure groups (status, assignee, notes) in this
    /// SQLite file (created if missing); without it the triage endpoints answer 404.
    #[arg(long, env = "RELIQ_TRIAGE_DB")]
    pub(crate) triage_db: Option<PathBuf>,
    /// A schema registry (Confluent-compatible API): registry-framed dead letters are
    /// shown decoded with their writer's schema, and an edit may send a corrected value
    /// as JSON, written back with that schema.
    #[arg(long, env = "RELIQ_SCHEMA_REGISTRY_URL")]
    pub(crate) schema_registry: Option<String>,
    /// Largest request body, bytes [default: 1048576].
    #[arg(long)]
    pub(crate) max_body_bytes: Option<usize>,
    /// A consumer the web console lists, as name=source, and its policy's retry
    /// tiers after an @ (billing=orders@1s,30s: the backlog of Kafka retry topics and
    /// RabbitMQ TTL queues is read by them). Repeat for several; replaces the file's list.
    #[arg(long = "consumer", value_name = "NAME=SOURCE[@TIERS]")]
    pub(crate) consumers: Vec<String>,
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, env = "RELIQ_ADMIN_TLS_CERT", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "RELIQ_ADMIN_TLS_KEY", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// How often the certificate and key files are read again; a changed pair is
    /// loaded without a restart [default: 30s].
    #[arg(long)]
    pub(crate) tls_reload_every: Option<humantime::Duration>,
    /// Mark the console's session cookie Secure (always so with --tls-cert; set it when
    /// a proxy in front terminates TLS).
    #[arg(long)]
    pub(crate) secure_cookies: bool,
    /// How long `/readyz` waits for the broker's answer [default: 3s].
    #[arg(long)]
    pub(crate) ready_timeout: Option<humantime::Duration>,
    /// On stop: how long running replays and purges may take to finish [default: 30s].
    #[arg(long)]
    pub(crate) job_grace: Option<humantime::Duration>,
    /// On stop: how long jobs cancelled after the grace get to confirm their copies in
    /// flight [default: 30s].
    #[arg(long)]
    pub(crate) hand_back: Option<humantime::Duration>,
    /// On stop: how long open requests get once the listener closes [default: 10s].
    #[arg(long)]
    pub(crate) request_grace: Option<humantime::Duration>,
    /// How often the broker-side gauges of the consumers (backlog, retries waiting,
    /// DLQ depth and oldest age) are read for `GET /metrics` [default: 15s].
    #[arg(long)]
    pub(crate) metrics_interval: Option<humantime::Duration>,
    /// How often the consumers' topology is checked against their plans for
    /// `reliq_topology_drift` (first at start) [default: 5m].
    #[arg(long)]
    pub(crate) topology_interval: Option<humantime::Duration>,
    /// Single sign-on for the console: the OpenID provider's issuer URL (with
    /// --oidc-client-id and --oidc-redirect-url, or the file's `[oidc]` table, which also
    /// maps the roles claim: by default `roles` values reliq-reader, reliq-operator,
    /// reliq-admin).
    #[arg(long, env = "RELIQ_OIDC_ISSUER")]
    pub(crate) oidc_issuer: Option<String>,
    /// The console's client id at the provider.
    #[arg(long, env = "RELIQ_OIDC_CLIENT_ID")]
    pub(crate) oidc_client_id: Option<String>,
    /// A file holding the client secret (or the secret itself in RELIQ_OIDC_CLIENT_SECRET).
    #[arg(long, env = "RELIQ_OIDC_CLIENT_SECRET_FILE")]
    pub(crate) oidc_client_secret_file: Option<PathBuf>,
    /// The client secret (from the environment only: a flag would show it in `ps`).
    #[arg(
        long,
        env = "RELIQ_OIDC_CLIENT_SECRET",
        hide = true,
        hide_env_values = true
    )]
    pub(crate) oidc_client_secret: Option<String>,
    /// The console's callback as browsers reach it: `https://<host>/console/oidc/callback`
    /// (registered at the provider, with `https://<host>/console/sign-in` for sign-out).
    #[arg(long, env = "RELIQ_OIDC_REDIRECT_URL")]
    pub(crate) oidc_redirect_url: Option<String>,
}

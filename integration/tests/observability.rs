//! The metrics end to end: the orders example with the Prometheus exporter
//! (`reliq_examples::metrics::serve`) on the real Kafka, scraped over HTTP. The consumer's
//! counters in the scrape agree with its own statistics and the example's summary line;
//! the publish counters with the relay's and the copies sent; the broker-side gauges
//! (lag, retries waiting per tier, DLQ depth) with Kafka's own numbers, read with rdkafka;
//! and every metric name the alert rules and the dashboard use is in a scrape.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use reliq::{BacklogGauges, DeadLetterFilter, Destination, Message, Replay};
use reliq_examples::orders::{self, Db};
use reliq_integration::settings;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// One scrape: `name{labels}` → value, and the metric names.
struct Scrape {
    samples: HashMap<String, f64>,
    names: BTreeSet<String>,
    text: String,
}

impl Scrape {
    async fn of(addr: std::net::SocketAddr) -> anyhow::Result<Self> {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: reliq\r\n\r\n")
            .await?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await?;
        let (head, body) = raw.split_once("\r\n\r\n").context("an HTTP answer")?;
        ensure!(
            head.starts_with("HTTP/1.") && head.contains(" 200 "),
            "{head}"
        );
        let mut samples = HashMap::new();
        let mut names = BTreeSet::new();
        for line in body
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').context("a sample line")?;
            let name = series.split('{').next().unwrap_or(series);
            names.insert(name.to_owned());
            samples.insert(series.to_owned(), value.parse::<f64>()?);
        }
        Ok(Self {
            samples,
            names,
            text: body.to_owned(),
        })
    }

    /// The values of `name`'s samples whose labels include every `label="value"` given.
    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&str, &str)],
    ) -> impl Iterator<Item = f64> + 'a {
        self.samples
            .iter()
            .filter(move |(series, _)| {
                series.split('{').next() == Some(name)
                    && labels
                        .iter()
                        .all(|(k, v)| series.contains(&format!("{k}=\"{v}\"")))
            })
            .map(|(_, v)| *v)
    }

    /// Their sum.
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).sum()
    }

    /// The value of the one series of `name` carrying `labels`.
    fn one(&self, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
        let found: Vec<f64> = self.matching(name, labels).collect();
        ensure!(
            found.len() == 1,
            "{name}{labels:?}: {} series in\n{}",
            found.len(),
            self.text
        );
        Ok(found[0])
    }
}

fn free_addr() -> anyhow::Result<std::net::SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// Kafka's own numbers, with rdkafka: records in `topic`, and those `group` has not
/// committed past.
struct RawKafka {
    bootstrap: String,
}

impl RawKafka {
    fn consumer(&self, group: &str) -> anyhow::Result<BaseConsumer> {
        Ok(ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()?)
    }

    fn partitions(&self, c: &BaseConsumer, topic: &str) -> anyhow::Result<Vec<i32>> {
        let md = c.fetch_metadata(Some(topic), Duration::from_secs(10))?;
        Ok(md
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .context("the topic")?
            .partitions()
            .iter()
            .map(|p| p.id())
            .collect())
    }

    fn records(&self, topic: &str) -> anyhow::Result<i64> {
        let c = self.consumer("reliq-observability-raw")?;
        let mut n = 0;
        for p in self.partitions(&c, topic)? {
            let (low, high) = c.fetch_watermarks(topic, p, Duration::from_secs(10))?;
            n += high - low;
        }
        Ok(n)
    }

    fn lag(&self, group: &str, topic: &str) -> anyhow::Result<i64> {
        let c = self.consumer(group)?;
        let partitions = self.partitions(&c, topic)?;
        let mut tpl = TopicPartitionList::new();
        for p in &partitions {
            tpl.add_partition(topic, *p);
        }
        let committed = c.committed_offsets(tpl, Duration::from_secs(10))?;
        let mut lag = 0;
        for p in partitions {
            let (low, high) = c.fetch_watermarks(topic, p, Duration::from_secs(10))?;
            let done = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o.max(low),
                _ => low,
            };
            lag += high - done;
        }
        Ok(lag)
    }
}

/// `promtool check metrics` (Prometheus's own linter: help text, units, counter suffixes)
/// on a scrape: silent and exit 0. `just test` installs promtool (`scripts/brokers
/// promtool`).
fn promtool_finds_nothing(scrape: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("promtool (install it with `scripts/brokers promtool`)")?;
    child
        .stdin
        .take()
        .context("promtool's stdin")?
        .write_all(scrape.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let reliq: Vec<&str> = said.lines().filter(|l| l.contains("reliq_")).collect();
    ensure!(
        reliq.is_empty(),
        "promtool check metrics on a scrape:\n{}",
        reliq.join("\n")
    );
    Ok(())
}

/// Every `reliq_…` name in `text` (an alert rule file, a dashboard), histogram series
/// (`_bucket`, `_sum`, `_count`) as they are scraped.
fn names_used(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("reliq_") {
        let start = i + at;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = text[start..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .map_or(text.len(), |e| start + e);
        if boundary {
            names.insert(text[start..end].to_owned());
        }
        i = end;
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_metrics_agree_with_the_run_and_with_kafka() -> anyhow::Result<()> {
    let addr = free_addr()?;
    reliq_examples::metrics::serve(addr)?;
    let url = settings::get("RELIQ_KAFKA_URL");
    let raw = RawKafka {
        bootstrap: url.trim_start_matches("kafka://").to_owned(),
    };
    let broker = reliq::connect(&url).await?;
    let topic = format!("orders-obs-{}", reliq::MessageId::generate());
    let dir = tempfile::tempdir()?;
    let db = Db::open(
        &format!("sqlite://{}", dir.path().join("orders.db").display()),
        None,
    )
    .await?;
    let sub = orders::consumer(broker.clone(), &topic, &db).subscription()?;
    let gauges = BacklogGauges::new(broker.clone(), [sub.clone()])
        .check_topology_every(Duration::from_secs(300));

    let n = 200;
    let summary = orders::run(broker.clone(), &db, &topic, n, Duration::from_secs(180)).await?;
    ensure!(summary.lost == 0, "{summary}");
    let failed = gauges.poll().await;
    ensure!(
        failed.is_empty(),
        "the gauges could not be read: {failed:?}"
    );
    let scrape = Scrape::of(addr).await?;
    // The poller checked the topology the consumer declared: as planned.
    for severity in ["breaking", "cosmetic"] {
        let labels = [("consumer", sub.consumer.as_str()), ("severity", severity)];
        let drift = scrape.one(reliq::metrics::TOPOLOGY_DRIFT, &labels)?;
        ensure!(
            drift == 0.0,
            "{severity} topology drift of the orders consumer: {drift}"
        );
    }

    // The consumer's counters are its statistics, and the summary line's.
    let c = [("consumer", orders::CONSUMER)];
    let s = &summary.stats;
    for (name, expected) in [
        (reliq::metrics::RECEIVED, s.received),
        (reliq::metrics::PROCESSED, s.processed),
        (reliq::metrics::RETRIED, s.retried),
        (reliq::metrics::DEAD_LETTERED, s.dead_lettered),
        (reliq::metrics::DUPLICATES, s.duplicates),
    ] {
        let got = scrape.sum(name, &c);
        ensure!(
            got == expected as f64,
            "{name}: scraped {got}, the consumer counted {expected}"
        );
    }
    let line = summary.to_string();
    ensure!(
        line.contains(&format!(
            "retried={}",
            scrape.sum(reliq::metrics::RETRIED, &c)
        )) && line.contains(&format!(
            "duplicates={}",
            scrape.sum(reliq::metrics::DUPLICATES, &c)
        )),
        "{line}"
    );
    ensure!(
        s.retried > 0 && s.dead_lettered > 0 && s.duplicates > 0,
        "{s:?}"
    );

    // Publishes: the relay's confirmed ones plus the second copies sent directly.
    let extra: u32 = orders::orders(n)?.iter().map(|o| o.copies - 1).sum();
    let published = scrape.sum(reliq::metrics::PUBLISHED, &[("destination", &topic)]);
    ensure!(
        published == (summary.relay.published + u64::from(extra)) as f64,
        "published {published}, relay {} + copies {extra}",
        summary.relay.published
    );
    ensure!(
        scrape.sum(reliq::metrics::OUTBOX_PUBLISHED, &[]) == summary.relay.published as f64,
        "the relay's counter"
    );
    let timed = scrape.sum(
        &format!("{}_count", reliq::metrics::PUBLISH_DURATION),
        &[("destination", &topic)],
    );
    ensure!(
        timed == published,
        "{timed} publishes timed, {published} counted"
    );

    // The broker-side gauges are Kafka's own numbers: the DLQ's dead letters (its records,
    // copies of one dead letter folded) and the group's lag.
    let labels = [("consumer", orders::CONSUMER), ("source", topic.as_str())];
    let dlq_gauge = scrape.one(reliq::metrics::DLQ_MESSAGES, &labels)?;
    let dlq_raw = raw.records(&sub.dead_letter_name())?;
    let dlq = orders::dead_letters(&broker, &sub).await?;
    let dlq_entries: usize = dlq.values().sum();
    ensure!(
        dlq_gauge == dlq_entries as f64
            && dlq_entries == dlq.len()
            && dlq_raw >= dlq_entries as i64
            && dlq_raw > 0,
        "DLQ gauge {dlq_gauge}, Kafka records {dlq_raw}, entries {dlq_entries} for {} ids",
        dlq.len()
    );
    let lag_gauge = scrape.one(reliq::metrics::BACKLOG, &labels)?;
    let lag_raw = raw.lag(orders::CONSUMER, &topic)?;
    ensure!(
        lag_gauge == lag_raw as f64 && lag_raw == 0,
        "lag gauge {lag_gauge}, Kafka {lag_raw}"
    );
    for delay in &sub.retry_tiers {
        let tier = reliq::metrics::tier_label(*delay);
        let mut l = labels.to_vec();
        l.push(("tier", &tier));
        let gauge = scrape.one(reliq::metrics::RETRY_WAITING, &l)?;
        let relay_group = format!("{}.retry.{}ms", orders::CONSUMER, delay.as_millis());
        let raw_lag = raw.lag(&relay_group, &sub.retry_name(*delay))?;
        ensure!(
            gauge == raw_lag as f64,
            "tier {tier}: gauge {gauge}, Kafka {raw_lag}"
        );
    }
    let age = scrape.one(reliq::metrics::DLQ_OLDEST_AGE, &labels)?;
    ensure!(age > 0.0 && age < 600.0, "oldest dead letter's age {age}");
    ensure!(scrape.one(reliq::metrics::BACKLOG_LAST_POLL, &labels)? > 1.7e9);
    ensure!(
        scrape.sum(
            reliq::metrics::PRODUCER_BUFFER_RATIO,
            &[("backend", "kafka")]
        ) >= 0.0
    );

    // A failed publish is counted by kind; a replay is counted.
    let bad = broker
        .publish(&Destination::new("not a valid topic!"), Message::new("x"))
        .await;
    ensure!(bad.is_err(), "a topic name Kafka refuses");
    // Any dead letter: replaying its id replays every copy parked under it (a poison
    // order published twice is parked twice).
    let (one, copies) = orders::dead_letters(&broker, &sub)
        .await?
        .into_iter()
        .next()
        .context("a dead letter")?;
    let report = Replay::new(broker.clone(), sub.clone())
        .filter(DeadLetterFilter::default().ids([one.clone()]))
        .execute()
        .await?;
    ensure!(
        report.replayed.len() == copies && report.replayed.iter().all(|id| *id == one),
        "{copies} copies of {one} parked: {report:?}"
    );

    // The embedded broker too (it reports what Kafka cannot: deliveries in flight), in the
    // same process: then every name the rules and the dashboard use is in one scrape.
    let memory = reliq::connect("memory://observability").await?;
    let db2 = Db::open(
        &format!("sqlite://{}", dir.path().join("memory.db").display()),
        None,
    )
    .await?;
    let mem_sub = orders::consumer(memory.clone(), "orders-mem", &db2).subscription()?;
    orders::run(
        memory.clone(),
        &db2,
        "orders-mem",
        40,
        Duration::from_secs(60),
    )
    .await?;
    let failed = BacklogGauges::new(memory, [mem_sub]).poll().await;
    ensure!(failed.is_empty(), "{failed:?}");
    let scrape = Scrape::of(addr).await?;
    ensure!(
        scrape.sum(
            reliq::metrics::PUBLISH_FAILURES,
            &[("kind", bad.as_ref().err().map_or("", |e| e.kind()))]
        ) == 1.0,
        "the failed publish, by kind"
    );
    ensure!(
        scrape.sum(reliq::metrics::REPLAYED, &c) == copies as f64,
        "the replay of {copies} copies"
    );

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for file in [
        "deploy/prometheus/reliq-rules.yml",
        "deploy/grafana/reliq-dashboard.json",
    ] {
        let text = std::fs::read_to_string(root.join(file))?;
        let used = names_used(&text);
        ensure!(!used.is_empty(), "{file} uses no reliq metric");
        let missing: Vec<_> = used.iter().filter(|n| !scrape.names.contains(*n)).collect();
        ensure!(
            missing.is_empty(),
            "{file} uses {missing:?}, not in a scrape"
        );
        for name in &used {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            ensure!(
                reliq::metrics::ALL_METRICS.contains(&base),
                "{file}: {name} is not one of reliq's metric names"
            );
        }
    }
    promtool_finds_nothing(&scrape.text)?;
    db.close().await;
    db2.close().await;
    Ok(())
}

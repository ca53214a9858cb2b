//! The crash harness: the orders service's inventory consumer (`reliq_examples::orders`)
//! is killed at random moments and between COMMIT and ack, restarted each time, and the
//! database and the DLQ are checked afterwards.
//!
//! - **Real brokers** (RabbitMQ, Kafka, NATS): the consumer runs as a child process
//!   (`src/bin/crash-consumer.rs`) and is killed with SIGKILL. For a kill between COMMIT
//!   and ack, the child is started with a fault switch (`--crash-after-commit k`): after
//!   the k-th committed reservation it reports the message id on stdout and holds the
//!   handler (no ack); the driver then sends SIGKILL.
//! - **Memory**: the broker lives in the driver's process and cannot outlive it, so the
//!   consumer runs in-process and "dies" with [`ConsumerHandle::crash`] (nothing in
//!   flight is settled, the receiver is dropped unclosed). Same scenario, same fault
//!   switch, but not a SIGKILL.
//!
//! The database (a SQLite file both processes open, or a fresh PostgreSQL schema) holds
//! the orders with their outbox (the driver places them and runs the relay) and the
//! inventory's stock, reservations and inbox (the consumer writes them).

use reliq_core::{
    BoxError, Broker, ConsumerBuilder, ConsumerHandle, Delivery, Duplicate, MessageId,
    StatsSnapshot, seam::lock,
};
use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use async_trait::async_trait;
use futures::future::BoxFuture;
use reliq_examples::orders::{self, CONSUMER, Db, Expected};
use reliq_memory::MemoryBroker;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::time::Instant;

use crate::settings;

/// The backend a scenario runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The embedded broker: in-process crashes (see the module docs).
    Memory,
    /// RabbitMQ.
    Rabbit,
    /// Kafka.
    Kafka,
    /// NATS JetStream.
    Nats,
    /// Amazon SQS (the moto emulator locally).
    Sqs,
}

impl Backend {
    /// Parse `memory | rabbit | kafka | nats | sqs`.
    pub fn parse(name: &str) -> anyhow::Result<Self> {
        Ok(match name {
            "memory" => Self::Memory,
            "rabbit" => Self::Rabbit,
            "kafka" => Self::Kafka,
            "nats" => Self::Nats,
            "sqs" => Self::Sqs,
            other => bail!("unknown backend `{other}` (memory|rabbit|kafka|nats|sqs)"),
        })
    }

    /// The name [`Backend::parse`] reads (the child processes' `--backend`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Rabbit => "rabbit",
            Self::Kafka => "kafka",
            Self::Nats => "nats",
            Self::Sqs => "sqs",
        }
    }

    /// How long the consumer must stay idle before the run counts as finished: longer
    /// than the time a killed consumer's unsettled deliveries take to come back.
    fn quiet_period(self) -> Duration {
        match self {
            // ack_wait (NATS) and the visibility timeout (SQS) = the consumer's lease
            // (LEASE below).
            Self::Nats | Self::Sqs => LEASE + Duration::from_secs(2),
            _ => Duration::from_secs(2),
        }
    }
}

/// The consumer's lease. On NATS it is `ack_wait`, on SQS the visibility timeout: a
/// killed consumer's deliveries come back after it. Not shorter on SQS: the dead
/// consumer's last long poll (half a lease) must end before its messages are visible
/// again (see the SQS conformance factory's `crash_lease`).
pub const LEASE: Duration = Duration::from_secs(3);

/// How long closing the run's store and dropping its schema may take.
const TEARDOWN: Duration = Duration::from_secs(30);

/// Connect to a real backend with the integration factories (their URLs from the
/// environment or `brokers.env`). On Kafka, `group_prefix` is the run's consumer-group
/// prefix (the parent and every child must use the same).
pub async fn connect(backend: Backend, group_prefix: &str) -> anyhow::Result<Arc<dyn Broker>> {
    Ok(match backend {
        Backend::Memory => bail!("the memory broker lives in one process"),
        Backend::Rabbit => Arc::new(crate::rabbit::RabbitBackend::broker().await?),
        Backend::Kafka => Arc::new(reliq_kafka::KafkaBroker::connect(
            &crate::kafka::url_with_group_prefix(group_prefix),
        )?),
        Backend::Nats => Arc::new(crate::nats::NatsBackend::new().connect_nats().await?),
        Backend::Sqs => {
            Arc::new(reliq_sqs::SqsBroker::connect(&settings::get("RELIQ_SQS_URL")).await?)
        }
    })
}

/// How long a consumer child keeps trying to reach its broker at startup.
const CONNECT_WAIT: Duration = Duration::from_secs(60);

/// [`connect`], tried again after connection errors and timeouts for up to a minute
/// (a warning per attempt), as a service does at startup: a consumer
/// restarted while its link is lossy or its node is down waits for the broker instead of
/// exiting (a lossy-link run's child timed out in the NATS handshake). Any other error
/// (a bad URL, refused credentials) ends it at once.
pub async fn connect_through_outages(
    backend: Backend,
    group_prefix: &str,
) -> anyhow::Result<Arc<dyn Broker>> {
    reliq_core::through_outage(
        "connecting to the broker",
        reliq_core::OutageWait::up_to(CONNECT_WAIT),
        |e: &anyhow::Error| {
            e.downcast_ref::<reliq_core::BrokerError>()
                .is_some_and(reliq_core::BrokerError::is_unreachable)
        },
        || connect(backend, group_prefix),
    )
    .await
}

/// The inventory consumer as the harness runs it: the example's settings, plus a short
/// lease (fast redelivery on NATS after a kill) and a delivery limit far above what five
/// kills can add to a message's deliveries.
pub fn consumer(broker: Arc<dyn Broker>, topic: &str, db: &Db) -> ConsumerBuilder {
    orders::consumer(broker, topic, db)
        .lease(LEASE)
        .delivery_limit(30)
}

/// What a consumer reports to the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Subscribed and running.
    Ready,
    /// The fault switch fired: this message's reservation committed and its handler is
    /// held before the ack, waiting to be killed.
    CommitAck(MessageId),
    /// The inbox found this message already claimed (acked and skipped).
    Duplicate(MessageId),
    /// Counters (every 200 ms, and `final` at a graceful stop).
    Stats(StatsSnapshot),
    /// The child's wall clock at startup, in ms since the Unix epoch, as it prints it;
    /// the driver keeps, instead, its offset from the driver's own clock on arrival (ms):
    /// what a skewed child's clock is off by.
    Clock(i64),
}

impl Event {
    /// The line the child prints.
    pub fn line(&self) -> String {
        match self {
            Self::Ready => "ready".into(),
            Self::Clock(ms) => format!("clock {ms}"),
            Self::CommitAck(id) => format!("commit-ack {id}"),
            Self::Duplicate(id) => format!("duplicate {id}"),
            Self::Stats(s) => format!(
                "stats {} {} {} {} {} {} {} {}",
                s.received,
                s.processed,
                s.retried,
                s.dead_lettered,
                s.duplicates,
                s.in_flight,
                s.settle_failures,
                s.released
            ),
        }
    }

    /// Parse a line of [`Event::line`].
    pub fn parse(line: &str) -> Option<Self> {
        let (kind, rest) = line.split_once(' ').unwrap_or((line, ""));
        Some(match kind {
            "ready" => Self::Ready,
            "clock" => Self::Clock(rest.parse().ok()?),
            "commit-ack" => Self::CommitAck(MessageId::from(rest.to_owned())),
            "duplicate" => Self::Duplicate(MessageId::from(rest.to_owned())),
            "stats" => {
                let n: Vec<u64> = rest
                    .split(' ')
                    .map(str::parse)
                    .collect::<Result<_, _>>()
                    .ok()?;
                let [
                    received,
                    processed,
                    retried,
                    dead_lettered,
                    duplicates,
                    in_flight,
                    settle_failures,
                    released,
                ] = n.as_slice().try_into().ok()?;
                Self::Stats(StatsSnapshot {
                    received,
                    processed,
                    retried,
                    dead_lettered,
                    duplicates,
                    in_flight,
                    settle_failures,
                    released,
                    ..StatsSnapshot::default()
                })
            }
            _ => return None,
        })
    }
}

/// A handler's report channel.
pub type Emit = Arc<dyn Fn(Event) + Send + Sync>;

/// The inventory handler with the fault switch: [`Db::reserve`]; after the
/// `crash_after_commit`-th committed reservation it emits [`Event::CommitAck`] and never
/// returns (the delivery is not acked; the process is about to die); every inbox
/// duplicate is emitted as [`Event::Duplicate`].
pub fn handler(
    db: Db,
    crash_after_commit: Option<u64>,
    emit: Emit,
) -> impl Fn(Delivery) -> BoxFuture<'static, Result<(), BoxError>> + Send + Sync + 'static {
    let commits = Arc::new(std::sync::atomic::AtomicU64::new(0));
    move |d: Delivery| {
        let (db, emit, commits) = (db.clone(), emit.clone(), commits.clone());
        Box::pin(async move {
            match db.reserve(CONSUMER, &d).await {
                Ok(()) => {
                    let n = commits.fetch_add(1, Ordering::SeqCst) + 1;
                    if crash_after_commit == Some(n) {
                        emit(Event::CommitAck(d.id().clone()));
                        std::future::pending::<()>().await;
                    }
                    Ok(())
                }
                Err(e) => {
                    if e.downcast_ref::<Duplicate>().is_some() {
                        emit(Event::Duplicate(d.id().clone()));
                    }
                    Err(e)
                }
            }
        })
    }
}

/// Where the scenario keeps its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// A SQLite file in a temporary directory.
    Sqlite,
    /// A fresh schema on `RELIQ_POSTGRES_URL`.
    Postgres,
}

impl Store {
    /// Parse `sqlite | postgres`.
    pub fn parse(name: &str) -> anyhow::Result<Self> {
        Ok(match name {
            "sqlite" => Self::Sqlite,
            "postgres" => Self::Postgres,
            other => bail!("unknown store `{other}` (sqlite|postgres)"),
        })
    }
}

/// One run of the harness.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// The backend.
    pub backend: Backend,
    /// The database.
    pub store: Store,
    /// Distinct orders (poison, unknown SKUs, transient failures and copies included).
    pub orders: u32,
    /// Kills (every second one between COMMIT and ack).
    pub kills: u32,
    /// Seed of the kill moments.
    pub seed: u64,
    /// The `crash-consumer` binary (real backends).
    pub child: PathBuf,
    /// Give up after this long.
    pub timeout: Duration,
    /// Environment of the consumer child beside the driver's own (a broker URL through a
    /// fault proxy: `RELIQ_KAFKA_URL=kafka://127.0.0.1:9392,…`). The driver's own
    /// connections (the relay, the checks) keep the driver's environment.
    pub child_env: Vec<(String, String)>,
    /// Freeze the last run's consumer (SIGSTOP) for this long once it has made progress,
    /// while a second member of its group (a standby child) runs, then thaw it (SIGCONT).
    /// Longer than the consumer's lease (NATS `ack_wait`, SQS visibility), Kafka session
    /// or RabbitMQ heartbeat timeout, the frozen consumer comes back as a *zombie*: what it
    /// held was handed to the standby meanwhile. Real brokers only.
    pub pause: Option<Duration>,
    /// Where the consumer child reaches the database instead of its URL's host (a fault
    /// proxy: `127.0.0.1:40123`), so its dependency can be cut while the broker and the
    /// driver's own connection to the database stay up. PostgreSQL only.
    pub child_db_host: Option<String>,
    /// Run the consumer child in this network namespace (`ip netns exec NAME`, root): a
    /// host of its own, whose links the chaos tests cut (`scripts/brokers cluster net`).
    pub child_netns: Option<String>,
}

/// Faults injected beside the consumer kills ([`run_with_faults`]: a broker node killed
/// and restarted, …): given the run's topic, inject them and say what was done, and when.
/// The run waits for them to end before its last consumer may go idle, so whatever a
/// fault held back is settled before the checks.
pub type Faults = Box<dyn FnOnce(String) -> BoxFuture<'static, anyhow::Result<Vec<String>>> + Send>;

/// What a run did (all checks passed).
#[derive(Clone, Debug)]
pub struct Report {
    /// The scenario's backend.
    pub backend: &'static str,
    /// The database.
    pub store: Store,
    /// Distinct orders published.
    pub orders: usize,
    /// Kills: SIGKILLs of the child (memory: `crash()` calls).
    pub kills: usize,
    /// Of which between COMMIT and ack.
    pub commit_ack_kills: usize,
    /// Orders reserved (each exactly once).
    pub reserved: usize,
    /// Duplicates the inbox absorbed (injected copies, redeliveries after kills).
    pub duplicates: usize,
    /// Distinct orders in the DLQ (exactly the injected poison and unknown SKUs).
    pub dead_lettered: usize,
    /// DLQ entries (a poison message redelivered after a kill, or published twice, is
    /// parked again), each with the reason its order was injected for.
    pub dlq_entries: usize,
    /// The entries the DLQ must hold at least: one per dead order, two for one published
    /// twice (unless the broker deduplicates publishes). Entries beyond it are dead
    /// letters made twice for one message.
    pub dlq_published: usize,
    /// Settlements the broker refused or did not confirm in time (summed over the runs'
    /// last reported counters): what a DLQ outage or a stalled connection costs.
    pub settle_failures: u64,
    /// Deliveries handed back to the broker after such a failure.
    pub released: u64,
    /// Valid orders that failed transiently first.
    pub transient: usize,
    /// Consumer runs (kills + the last one + the standby of a pause).
    pub runs: usize,
    /// Every order sorted by what became of it.
    pub outcomes: Outcomes,
    /// Wall time.
    pub elapsed: Duration,
    /// What the [`Faults`] of [`run_with_faults`] injected, and when.
    pub faults: Vec<String>,
    /// The [`Scenario::pause`], as done.
    pub pause: Option<String>,
    /// Deliveries the frozen consumer held when it was frozen (0 without a pause): what
    /// it can settle again as a zombie once thawed.
    pub held_when_frozen: u64,
    /// How far each consumer process's wall clock was off the driver's at its start (ms),
    /// in the order they started: about 0, unless the run skews them
    /// ([`crate::skew::child_env`]).
    pub clock_offsets_ms: Vec<i64>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "crash backend={} store={:?} orders={} kills={} commit_ack_kills={} reserved={} \
             duplicates={} dead_lettered={} dlq_entries={} dlq_published={} transient={} settle_failures={} \
             released={} runs={} {} secs={:.1}",
            self.backend,
            self.store,
            self.orders,
            self.kills,
            self.commit_ack_kills,
            self.reserved,
            self.duplicates,
            self.dead_lettered,
            self.dlq_entries,
            self.dlq_published,
            self.transient,
            self.settle_failures,
            self.released,
            self.runs,
            self.outcomes,
            self.elapsed.as_secs_f64()
        )?;
        if self.clock_offsets_ms.iter().any(|ms| ms.abs() >= 1_000) {
            let offsets: Vec<String> = self
                .clock_offsets_ms
                .iter()
                .map(|ms| format!("{:+.1} s", *ms as f64 / 1000.0))
                .collect();
            write!(f, "\n  consumer clocks off by: {}", offsets.join(", "))?;
        }
        for fault in &self.faults {
            write!(f, "\n  fault: {fault}")?;
        }
        if let Some(pause) = &self.pause {
            write!(f, "\n  pause: {pause}")?;
        }
        Ok(())
    }
}

/// Events of every consumer run, tagged with the run's index.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<(usize, Event)>>>);

impl Events {
    fn push(&self, run: usize, e: Event) {
        lock(&self.0).push((run, e));
    }

    fn all(&self) -> Vec<(usize, Event)> {
        lock(&self.0).clone()
    }

    fn find(&self, run: usize, pick: impl Fn(&Event) -> Option<Event>) -> Option<Event> {
        self.all()
            .into_iter()
            .rev()
            .filter(|(r, _)| *r == run)
            .find_map(|(_, e)| pick(&e))
    }

    fn stats(&self, run: usize) -> Option<StatsSnapshot> {
        match self.find(run, |e| matches!(e, Event::Stats(_)).then(|| e.clone())) {
            Some(Event::Stats(s)) => Some(s),
            _ => None,
        }
    }

    /// How many events there are (a mark for [`Events::first_stats_after`]).
    fn len(&self) -> usize {
        lock(&self.0).len()
    }

    /// Run `run`'s first counters reported after the first `mark` events.
    fn first_stats_after(&self, run: usize, mark: usize) -> Option<StatsSnapshot> {
        lock(&self.0).iter().skip(mark).find_map(|(r, e)| match e {
            Event::Stats(s) if *r == run => Some(*s),
            _ => None,
        })
    }
}

/// How the driver starts and kills the consumer.
#[async_trait]
trait Runner: Send {
    /// Start run `run` (events go to `events`).
    async fn start(&mut self, run: usize, crash_after_commit: Option<u64>) -> anyhow::Result<()>;
    /// The running consumer's latest counters.
    fn stats(&self) -> Option<StatsSnapshot>;
    /// Kill it; returns how (checked: "SIGKILL" only if the OS says so).
    async fn kill(&mut self) -> anyhow::Result<&'static str>;
    /// Stop it gracefully.
    async fn stop(&mut self) -> anyhow::Result<()>;
    /// Freeze it for `pause` (SIGSTOP, then SIGCONT); returns how.
    async fn freeze(&mut self, pause: Duration) -> anyhow::Result<String>;
    /// A second consumer like this one, not started (the standby of a pause).
    fn standby(&self) -> anyhow::Result<Box<dyn Runner>>;
}

/// `kill -<signal> <pid>`: the procps binary, so the harness needs no unsafe `libc::kill`.
async fn signal(pid: u32, signal: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .await
        .context("running kill")?;
    ensure!(status.success(), "kill -{signal} {pid}: {status}");
    Ok(())
}

/// The consumer as a child process.
struct ChildRunner {
    exe: PathBuf,
    /// The network namespace it runs in ([`Scenario::child_netns`]).
    netns: Option<String>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    events: Events,
    run: usize,
    child: Option<RunningChild>,
    /// Where a child that exits on its own says so (shared with the driver's [`Until`]).
    exited: Arc<Mutex<Option<String>>>,
}

struct RunningChild {
    child: Child,
    stdin: ChildStdin,
    /// Set before the driver kills or stops it: its end is then expected.
    ending: Arc<AtomicBool>,
}

#[async_trait]
impl Runner for ChildRunner {
    async fn start(&mut self, run: usize, crash_after_commit: Option<u64>) -> anyhow::Result<()> {
        let mut cmd = match &self.netns {
            Some(netns) => {
                // `ip netns exec` execs the child: its PID is the child's (kills, pauses).
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", netns]).arg(&self.exe);
                cmd
            }
            None => Command::new(&self.exe),
        };
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if let Some(k) = crash_after_commit {
            cmd.args(["--crash-after-commit", &k.to_string()]);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.exe.display()))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let stdin = child.stdin.take().context("child stdin")?;
        let events = self.events.clone();
        let ending = Arc::new(AtomicBool::new(false));
        let (ended, exited) = (ending.clone(), self.exited.clone());
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match Event::parse(line.trim()) {
                    Some(Event::Clock(child_ms)) => {
                        events.push(run, Event::Clock(child_ms - crate::skew::unix_ms_now()));
                    }
                    Some(e) => events.push(run, e),
                    None => tracing::warn!(%line, "unexpected line from the child"),
                }
            }
            // Its output closes when it exits: unless the driver ended it, the run can
            // no longer make progress, and waiting for it would only end at the deadline.
            if !ended.load(Ordering::SeqCst) {
                lock(&exited).get_or_insert(format!("consumer run {run} exited on its own"));
            }
        });
        self.child = Some(RunningChild {
            child,
            stdin,
            ending,
        });
        self.run = run;
        Ok(())
    }

    fn stats(&self) -> Option<StatsSnapshot> {
        self.events.stats(self.run)
    }

    async fn kill(&mut self) -> anyhow::Result<&'static str> {
        let RunningChild {
            mut child, ending, ..
        } = self.child.take().context("no child to kill")?;
        ensure!(
            child.try_wait()?.is_none(),
            "the child died before the kill"
        );
        ending.store(true, Ordering::SeqCst);
        child.start_kill()?;
        let status = child.wait().await?;
        ensure!(
            status.signal() == Some(9),
            "child ended with {status:?}, not by SIGKILL"
        );
        Ok("SIGKILL")
    }

    async fn stop(&mut self) -> anyhow::Result<()> {
        let RunningChild {
            mut child,
            stdin,
            ending,
        } = self.child.take().context("no child to stop")?;
        ending.store(true, Ordering::SeqCst);
        drop(stdin); // EOF on stdin: the child shuts down gracefully
        let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
            .await
            .context("the child did not stop")??;
        ensure!(status.success(), "child ended with {status:?}");
        Ok(())
    }

    async fn freeze(&mut self, pause: Duration) -> anyhow::Result<String> {
        let RunningChild { child, .. } = self.child.as_mut().context("no child to freeze")?;
        let pid = child.id().context("the child has exited")?;
        signal(pid, "STOP").await?;
        let frozen = Instant::now();
        tokio::time::sleep(pause).await;
        // Thawed whatever the sleep's outcome: a child left stopped would hang the run.
        signal(pid, "CONT").await?;
        ensure!(child.try_wait()?.is_none(), "the child died while frozen");
        Ok(format!(
            "run {}: SIGSTOP, SIGCONT {:.1}s later",
            self.run,
            frozen.elapsed().as_secs_f64()
        ))
    }

    fn standby(&self) -> anyhow::Result<Box<dyn Runner>> {
        Ok(Box::new(Self {
            exe: self.exe.clone(),
            netns: self.netns.clone(),
            args: self.args.clone(),
            env: self.env.clone(),
            events: self.events.clone(),
            run: 0,
            child: None,
            exited: self.exited.clone(),
        }))
    }
}

/// The consumer in this process, on the in-process broker.
struct InProcess {
    broker: Arc<dyn Broker>,
    db: Db,
    topic: String,
    events: Events,
    handle: Option<ConsumerHandle>,
}

#[async_trait]
impl Runner for InProcess {
    async fn start(&mut self, run: usize, crash_after_commit: Option<u64>) -> anyhow::Result<()> {
        let events = self.events.clone();
        let emit: Emit = Arc::new(move |e| events.push(run, e));
        let handle = consumer(self.broker.clone(), &self.topic, &self.db)
            .start(handler(self.db.clone(), crash_after_commit, emit.clone()))
            .await?;
        emit(Event::Ready);
        self.handle = Some(handle);
        Ok(())
    }

    fn stats(&self) -> Option<StatsSnapshot> {
        self.handle.as_ref().map(ConsumerHandle::stats)
    }

    async fn kill(&mut self) -> anyhow::Result<&'static str> {
        let handle = self.handle.take().context("no consumer to crash")?;
        handle.crash().await;
        Ok("ConsumerHandle::crash")
    }

    async fn stop(&mut self) -> anyhow::Result<()> {
        let handle = self.handle.take().context("no consumer to stop")?;
        handle.shutdown().await;
        Ok(())
    }

    async fn freeze(&mut self, _: Duration) -> anyhow::Result<String> {
        bail!("a consumer in the driver's process cannot be frozen alone")
    }

    fn standby(&self) -> anyhow::Result<Box<dyn Runner>> {
        bail!("the memory broker's scenario has no standby consumer")
    }
}

/// Run a scenario: place the orders, kill and restart the consumer `kills` times, let
/// the last run finish, then check the database and the DLQ. Fails on any lost, doubly
/// reserved or wrongly dead-lettered order, and when the kills did not happen as planned.
pub async fn run(s: Scenario) -> anyhow::Result<Report> {
    run_inner(s, None).await
}

/// [`run`], with `faults` injected during the run: started once the orders are in the
/// outbox, awaited before the checks.
pub async fn run_with_faults(s: Scenario, faults: Faults) -> anyhow::Result<Report> {
    run_inner(s, Some(faults)).await
}

async fn run_inner(s: Scenario, during: Option<Faults>) -> anyhow::Result<Report> {
    let started = Instant::now();
    let temp = tempfile::tempdir()?;
    let (db_url, schema) = match s.store {
        Store::Sqlite => (
            format!("sqlite://{}", temp.path().join("orders.db").display()),
            None,
        ),
        Store::Postgres => (
            settings::get("RELIQ_POSTGRES_URL"),
            Some(crate::stores::unique("crash")),
        ),
    };
    let db = Db::open(&db_url, schema.as_deref()).await?;
    let outcome = async {
        db.setup().await?;
        drive(&s, &db, &db_url, schema.as_deref(), during).await
    }
    .await;
    // The teardown is bounded and comes after the run's own error: a pool closes once
    // every connection is back and a schema drops once no transaction holds its tables,
    // so a connection stuck in a failed run would otherwise hang here and hide why.
    let teardown = async {
        db.close().await;
        if let Some(schema) = &schema {
            Db::drop_schema(&db_url, schema).await?;
        }
        anyhow::Ok(())
    };
    let teardown = tokio::time::timeout(TEARDOWN, teardown)
        .await
        .unwrap_or_else(|_| {
            Err(anyhow::anyhow!(
                "the store's teardown took longer than {TEARDOWN:?}"
            ))
        });
    let mut report = match (outcome, teardown) {
        (Ok(report), Ok(())) => report,
        (Err(run), Ok(())) => return Err(run),
        (Ok(_), Err(teardown)) => return Err(teardown),
        (Err(run), Err(teardown)) => {
            eprintln!("after the run failed: {teardown:#}");
            return Err(run);
        }
    };
    report.elapsed = started.elapsed();
    Ok(report)
}

/// Publish `message`, again every 500 ms while the broker answers with a lost connection,
/// a timeout, a closed client or a negative confirm (until `deadline`) — as the outbox
/// relay does, which releases the rows of any failed publish for a later round. A nack
/// is RabbitMQ's answer while a quorum queue has no leader (a node killed or cut off);
/// any other error fails at once.
async fn publish_through_outages(
    broker: &Arc<dyn Broker>,
    destination: &reliq_core::Destination,
    message: &reliq_core::Message,
    deadline: Instant,
) -> anyhow::Result<()> {
    let every = Duration::from_millis(500);
    let wait = reliq_core::OutageWait {
        within: deadline.saturating_duration_since(Instant::now()),
        first: every,
        longest: every,
    };
    reliq_core::through_outage(
        "publishing a second copy",
        wait,
        |e: &reliq_core::BrokerError| {
            e.is_unreachable()
                || matches!(
                    e,
                    reliq_core::BrokerError::Closed | reliq_core::BrokerError::Rejected { .. }
                )
        },
        || broker.publish(destination, message.clone()),
    )
    .await?;
    Ok(())
}

/// Where the run's waits stop: its deadline, or at once when an injected fault failed
/// (a wait for progress that fault was to allow would otherwise last until the deadline).
#[derive(Clone)]
struct Until {
    deadline: Instant,
    fault_failed: Arc<Mutex<Option<String>>>,
    /// Set by a consumer child that exited on its own (not killed or stopped by the
    /// driver): nothing it was waited for can come any more.
    consumer_exited: Arc<Mutex<Option<String>>>,
}

impl Until {
    fn check(&self, what: &str) -> anyhow::Result<()> {
        if let Some(e) = lock(&self.fault_failed).as_ref() {
            bail!("an injected fault failed while waiting for {what}: {e}");
        }
        if let Some(e) = lock(&self.consumer_exited).as_ref() {
            bail!("{e} while the driver waited for {what} (its error is in its stderr above)");
        }
        ensure!(
            Instant::now() < self.deadline,
            "timed out waiting for {what}"
        );
        Ok(())
    }
}

/// Poll `f` every 10 ms until it returns `Some`, or fail at `until` saying `what`.
async fn wait_for<T>(
    what: &str,
    until: &Until,
    mut f: impl AsyncFnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    loop {
        if let Some(v) = f().await? {
            return Ok(v);
        }
        until.check(what)?;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn drive(
    s: &Scenario,
    db: &Db,
    db_url: &str,
    schema: Option<&str>,
    during: Option<Faults>,
) -> anyhow::Result<Report> {
    let deadline = Instant::now() + s.timeout;
    let until = Until {
        deadline,
        fault_failed: Arc::default(),
        consumer_exited: Arc::default(),
    };
    let mut rng = fastrand::Rng::with_seed(s.seed);
    let topic = reliq_conformance::support::unique("crash");
    let events = Events::default();
    let group_prefix = reliq_conformance::support::unique("crash");
    let (broker, mut runner): (Arc<dyn Broker>, Box<dyn Runner>) = match s.backend {
        Backend::Memory => {
            let broker: Arc<dyn Broker> = Arc::new(MemoryBroker::new());
            let runner = InProcess {
                broker: broker.clone(),
                db: db.clone(),
                topic: topic.clone(),
                events: events.clone(),
                handle: None,
            };
            (broker, Box::new(runner))
        }
        backend => {
            let child_db = s.child_db_host.as_deref().map_or_else(
                || db_url.to_owned(),
                |host| settings::with_hosts(db_url, host),
            );
            let mut args: Vec<String> = [
                "--backend",
                backend.name(),
                "--group-prefix",
                &group_prefix,
                "--db",
                &child_db,
                "--topic",
                &topic,
            ]
            .map(String::from)
            .to_vec();
            if let Some(schema) = schema {
                args.extend(["--schema".to_owned(), schema.to_owned()]);
            }
            let runner = ChildRunner {
                exe: s.child.clone(),
                netns: s.child_netns.clone(),
                args,
                env: s.child_env.clone(),
                events: events.clone(),
                run: 0,
                child: None,
                exited: until.consumer_exited.clone(),
            };
            (connect(backend, &group_prefix).await?, Box::new(runner))
        }
    };

    let stream = orders::orders(s.orders)?;
    let expected = Expected::of(&stream);
    let valid = expected.valid.len() as u64;
    // Kill moments: each kill after a random share (up to 1/(2·kills)) of the valid orders
    // has been reserved since its run started, so all of them fall in the first half.
    let step = (valid / (u64::from(s.kills.max(1)) * 2)).max(5);
    let kills_planned = s.kills as usize;
    let commit_ack = |i: usize| i % 2 == 1;
    // Per killed run: the commit whose ack it dies before, or None for a random kill.
    let plan: Vec<Option<u64>> = (0..kills_planned)
        .map(|i| commit_ack(i).then(|| rng.u64(1..=step)))
        .collect();
    let ready = |run: usize| {
        let events = events.clone();
        async move || Ok(events.find(run, |e| (*e == Event::Ready).then(|| e.clone())))
    };

    // The first run subscribes before anything is published (it declares the topology).
    runner.start(0, plan.first().copied().flatten()).await?;
    wait_for("the first consumer", &until, ready(0)).await?;
    // A pause's standby stays to the end. Without kills it joins the group before the
    // orders come; with kills, after the last one, so that each killed run does the work
    // alone: beside a standby a killed run waited for progress the standby had already
    // made (round AJ), and a commit-ack kill may wait for a commit that never comes.
    let standby_run = kills_planned + 1;
    let join_standby = async |runner: &dyn Runner| -> anyhow::Result<Box<dyn Runner>> {
        let mut second = runner.standby()?;
        second.start(standby_run, None).await?;
        wait_for("the standby consumer", &until, ready(standby_run)).await?;
        Ok(second)
    };
    let mut standby = match s.pause {
        Some(_) if kills_planned == 0 => Some(join_standby(&*runner).await?),
        _ => None,
    };
    let destination = orders::destination(&topic);
    let messages: Vec<_> = stream.iter().map(|o| o.message.clone()).collect();
    ensure!(db.place(&destination, &messages).await? == stream.len());
    let relay = db.relay(broker.clone())?;
    // The moment the faults are timed from.
    let in_outbox = Instant::now();
    let faults = during.map(|inject| {
        let (injected, failed) = (inject(topic.clone()), until.fault_failed.clone());
        tokio::spawn(async move {
            let result = injected.await;
            if let Err(e) = &result {
                *lock(&failed) = Some(format!("{e:#}"));
            }
            result
        })
    });
    // The second copies: a relay that died between the broker's confirm and the mark.
    // Published as a relay would: again after a lost connection (a cluster node killed
    // meanwhile), a copy more for the inbox to absorb if the first attempt was stored.
    for order in stream.iter().filter(|o| o.copies > 1) {
        for _ in 1..order.copies {
            publish_through_outages(&broker, &destination, &order.message, deadline).await?;
        }
    }

    let mut kills: Vec<(&'static str, Option<MessageId>)> = Vec::new();
    for (run, crash_after_commit) in plan.iter().copied().enumerate() {
        if run > 0 {
            runner.start(run, crash_after_commit).await?;
            wait_for("a restarted consumer", &until, ready(run)).await?;
        }
        let held = if crash_after_commit.is_some() {
            let events = events.clone();
            let id = wait_for("the commit-ack fault", &until, async || {
                Ok(
                    match events.find(run, |e| matches!(e, Event::CommitAck(_)).then(|| e.clone()))
                    {
                        Some(Event::CommitAck(id)) => Some(id),
                        _ => None,
                    },
                )
            })
            .await?;
            Some(id)
        } else {
            let target = db.reserved_orders().await? + rng.u64(1..=step);
            // A run that stops making progress says so every 30 s, with the consumer's
            // last counters (a stuck runtime and a slow one look alike from outside).
            let mut said_at = Instant::now();
            wait_for("progress before a kill", &until, async || {
                let reserved = db.reserved_orders().await?;
                if said_at.elapsed() >= Duration::from_secs(30) {
                    said_at = Instant::now();
                    eprintln!(
                        "run {run}: {reserved} orders reserved, waiting for {target}; the consumer's last counters: {:?}",
                        events.stats(run)
                    );
                }
                Ok((reserved >= target).then_some(()))
            })
            .await?;
            tokio::time::sleep(Duration::from_millis(rng.u64(0..20))).await;
            None
        };
        let how = runner.kill().await?;
        tracing::info!(run, how, held = ?held, "killed");
        kills.push((how, held));
    }

    // The last run finishes the work; it is stopped once everything is reserved and it
    // has been idle for longer than a killed run's deliveries take to come back.
    if s.pause.is_some() && standby.is_none() {
        standby = Some(join_standby(&*runner).await?);
    }
    let last = kills.len();
    if last > 0 {
        // (Without kills the first run is the last.)
        runner.start(last, None).await?;
        wait_for("the last consumer", &until, ready(last)).await?;
    }
    // A pause: the last run is frozen early in its work (holding deliveries), and
    // thawed after the standby took them over.
    let mut pause = None;
    if let Some(length) = s.pause {
        let target = valid / 8 + rng.u64(0..=valid / 8);
        wait_for("progress before the pause", &until, async || {
            Ok((db.reserved_orders().await? >= target).then_some(()))
        })
        .await?;
        // A zombie is only one while it holds something: wait (a while) until the run
        // holds deliveries. A Kafka member that has just joined holds none until the
        // group has rebalanced.
        let holding_by = Instant::now() + Duration::from_secs(30);
        while runner.stats().is_none_or(|st| st.in_flight == 0) && Instant::now() < holding_by {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // What it held: its last counters before the freeze (up to 200 ms old) and its
        // first after the thaw, which it reports before a held delivery can be settled
        // (that takes a round trip to the broker).
        let before = runner.stats().map_or(0, |st| st.in_flight);
        let mark = events.len();
        let frozen_at = in_outbox.elapsed();
        let how = runner.freeze(length).await?;
        let after = wait_for("the thawed consumer's counters", &until, async || {
            Ok(events.first_stats_after(last, mark))
        })
        .await?;
        let held = before.max(after.in_flight);
        pause = Some((
            format!(
                "{how}, holding {held} deliveries when frozen (at +{:.1} s from the orders in the outbox)",
                frozen_at.as_secs_f64()
            ),
            held,
        ));
    }
    wait_for("every valid order reserved", &until, async || {
        Ok((db.reserved_orders().await? >= valid).then_some(()))
    })
    .await?;
    // The relay marks what it sent; a mark that failed (the database locked by a frozen
    // consumer's open transaction) is made on a later pass, after sending the row again.
    wait_for(
        "the relay to mark every outbox row sent",
        &until,
        async || Ok((db.unsent().await? == 0).then_some(())),
    )
    .await?;
    // What a fault held back (a dead letter the DLQ refused) is settled after it ends.
    let faults = match faults {
        Some(injected) => tokio::time::timeout_at(deadline, injected)
            .await
            .context("timed out waiting for the faults to end")?
            .context("the fault task panicked")??,
        None => Vec::new(),
    };
    let quiet = s.backend.quiet_period();
    let mut seen = (None, Instant::now());
    wait_for("the last consumers to go idle", &until, async || {
        let stats = [Some(runner.stats()), standby.as_ref().map(|r| r.stats())];
        let stats: Vec<_> = stats.into_iter().flatten().collect();
        let key: Vec<_> = stats
            .iter()
            .map(|st| st.map(|s| (s.received, s.in_flight)))
            .collect();
        if Some(&key) != seen.0.as_ref() {
            seen = (Some(key), Instant::now());
        }
        let idle = stats.iter().all(|st| st.is_some_and(|s| s.in_flight == 0));
        Ok((idle && seen.1.elapsed() >= quiet).then_some(()))
    })
    .await?;
    runner.stop().await?;
    if let Some(second) = standby.as_mut() {
        second.stop().await?;
    }
    relay.shutdown().await;
    ensure!(db.unsent().await? == 0, "outbox rows left unsent");

    // A failed check names the faults beside it, so it says what it followed.
    let mut report = check(s, db, &broker, &topic, &expected, &events, &kills)
        .await
        .map_err(|e| {
            if faults.is_empty() {
                return e;
            }
            let timeline: String = faults.iter().map(|f| format!("\n  fault: {f}")).collect();
            e.context(format!(
                "the check failed after these faults (from the moment the orders were in the outbox):{timeline}"
            ))
        })?;
    report.faults = faults;
    if let Some((how, held)) = pause {
        report.pause = Some(how);
        report.held_when_frozen = held;
    }
    Ok(report)
}

/// The DLQ entries of `ids`, one line each: position and headers.
async fn parked_copies(
    broker: &Arc<dyn Broker>,
    topic: &str,
    ids: &HashSet<&MessageId>,
) -> anyhow::Result<String> {
    let reader = broker.dead_letters(&orders::subscription(topic)).await?;
    let mut out = String::new();
    let mut cursor = reliq_core::Cursor::start();
    loop {
        let page = reader.browse(&cursor, 500).await?;
        for e in page.entries.iter().filter(|e| ids.contains(e.id())) {
            let mut headers: Vec<_> = e.headers().iter().collect();
            headers.sort();
            out.push_str(&format!("\n  {} at {}: {headers:?}", e.id(), e.position));
        }
        if page.at_end {
            return Ok(out);
        }
        cursor = page.next;
    }
}

async fn check(
    s: &Scenario,
    db: &Db,
    broker: &Arc<dyn Broker>,
    topic: &str,
    expected: &Expected,
    events: &Events,
    kills: &[(&'static str, Option<MessageId>)],
) -> anyhow::Result<Report> {
    let valid: HashSet<&str> = expected.valid.keys().map(MessageId::as_str).collect();
    let rows = db.reservations().await?;
    let sub = orders::subscription(topic);
    let dlq = orders::dead_letter_reasons(broker, &sub).await?;
    // A second copy of an order reaches the consumer unless the broker dropped it at
    // publish (NATS deduplicates a message id within its window).
    let copies_delivered = !broker.capabilities().deduplicates_publishes;
    let outcomes = Outcomes::sort(expected, &rows, &dlq, events);
    println!("{outcomes}");
    // Every valid order reserved exactly once; nothing else reserved.
    exactly_once("reservations", &valid, &rows)?;
    // The inbox holds each processed id once.
    let inbox = db.inbox_rows(CONSUMER).await?;
    exactly_once("inbox rows", &valid, &inbox)?;
    ensure!(
        db.stock().await? == expected.stock(),
        "stock differs from the orders"
    );
    // The DLQ holds exactly the injected poison and unknown SKUs, every copy parked with
    // the reason its order was injected for.
    let missing: Vec<_> = expected
        .dead
        .keys()
        .filter(|id| !dlq.contains_key(*id))
        .collect();
    // With the reasons they were parked for (a valid order parked `max-deliveries` was
    // delivered more often than the broker's delivery limit).
    let unexpected: Vec<_> = dlq
        .iter()
        .filter(|(id, _)| !expected.dead.contains_key(*id))
        .collect();
    ensure!(
        missing.is_empty() && unexpected.is_empty(),
        "DLQ: {} injected orders missing ({missing:?}), {} unexpected ({unexpected:?})",
        missing.len(),
        unexpected.len()
    );
    let wrong_reason: Vec<_> = dlq
        .iter()
        .filter(|(id, reasons)| reasons.iter().any(|r| Some(r) != expected.dead.get(*id)))
        .collect();
    ensure!(
        wrong_reason.is_empty(),
        "DLQ: {} orders parked with another reason than injected: {wrong_reason:?}",
        wrong_reason.len()
    );
    {
        // Each poison order is one dead letter, however often it was parked: published
        // twice, its DLQ copy sent again after a lost confirm, parked again after a kill
        // or by a zombie — the broker deduplicates the writes (NATS) or the DLQ reader
        // folds the copies (the rest); the operator tools see one entry.
        let twice: Vec<_> = dlq.iter().filter(|(_, r)| r.len() != 1).collect();
        if !twice.is_empty() {
            // Each copy's position and headers (when, at which attempt, from which
            // delivery): what tells a lost deduplication from a late second parking.
            let ids: HashSet<&MessageId> = twice.iter().map(|(id, _)| *id).collect();
            let copies = parked_copies(broker, topic, &ids)
                .await
                .unwrap_or_else(|e| format!("\n  (reading the copies failed: {e:#})"));
            bail!(
                "DLQ: {} orders shown more than once: {twice:?}; the copies:{copies}",
                twice.len()
            );
        }
    }
    // What `reliq dlq stats` and the `reliq_dlq_messages` gauge report: the dead letters.
    let counted = broker.dead_letters(&sub).await?.count().await?.count;
    ensure!(
        counted == expected.dead.len() as u64,
        "the DLQ counts {counted} dead letters for {} parked orders",
        expected.dead.len()
    );
    let dlq_published = expected.dead.len();

    // The kills happened as planned, and the inbox absorbed what it had to.
    ensure!(kills.len() == s.kills as usize, "{} kills", kills.len());
    if s.backend != Backend::Memory {
        ensure!(kills.iter().all(|(how, _)| *how == "SIGKILL"));
    }
    let duplicates: Vec<(usize, MessageId)> = events
        .all()
        .into_iter()
        .filter_map(|(run, e)| match e {
            Event::Duplicate(id) => Some((run, id)),
            _ => None,
        })
        .collect();
    let held: Vec<(usize, &MessageId)> = kills
        .iter()
        .enumerate()
        .filter_map(|(run, (_, id))| id.as_ref().map(|id| (run, id)))
        .collect();
    ensure!(
        s.kills < 2 || !held.is_empty(),
        "no kill between COMMIT and ack"
    );
    for (run, id) in &held {
        ensure!(
            duplicates.iter().any(|(r, d)| r > run && d == *id),
            "{id}, killed between COMMIT and ack in run {run}, was not absorbed as a duplicate later"
        );
    }
    // The second copies reach the consumer unless the broker dropped them at publish
    // (NATS deduplicates a message id within its window).
    for id in expected.valid_copies.iter().filter(|_| copies_delivered) {
        ensure!(
            duplicates.iter().any(|(_, d)| d == id),
            "the second copy of {id} was not absorbed as a duplicate"
        );
    }
    // Each run's last counters (a child reports them every 200 ms and when it stops; an
    // in-process run reports none).
    let runs = kills.len() + 1 + usize::from(s.pause.is_some());
    let last_stats: Vec<StatsSnapshot> = (0..runs).filter_map(|run| events.stats(run)).collect();
    Ok(Report {
        backend: s.backend.name(),
        store: s.store,
        orders: expected.valid.len() + expected.dead.len(),
        kills: kills.len(),
        commit_ack_kills: held.len(),
        reserved: rows.len(),
        duplicates: duplicates.len(),
        dead_lettered: dlq.len(),
        dlq_entries: dlq.values().map(Vec::len).sum(),
        dlq_published,
        transient: expected.transient,
        settle_failures: last_stats.iter().map(|st| st.settle_failures).sum(),
        released: last_stats.iter().map(|st| st.released).sum(),
        runs,
        outcomes,
        elapsed: Duration::ZERO,
        faults: Vec::new(),
        pause: None,
        held_when_frozen: 0,
        clock_offsets_ms: events
            .all()
            .into_iter()
            .filter_map(|(_, e)| match e {
                Event::Clock(offset) => Some(offset),
                _ => None,
            })
            .collect(),
    })
}

/// Every order placed, sorted by what became of it (the categories of RabbitMQ's Jepsen
/// suite, for effects): a valid order's effect is its reservation, an injected one's is
/// its DLQ entry. Lost orders are also counted by where they were placed, and DLQ entries
/// beyond one per published copy are counted apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcomes {
    /// Done once, delivered once.
    pub once: usize,
    /// Done once although delivered again (a second copy, a redelivery after a kill or a
    /// lost connection): the inbox absorbed the repeat.
    pub recovered: usize,
    /// Placed, and never done (no reservation; an injected one not in the DLQ).
    pub lost: usize,
    /// Done but never placed, or done the wrong way (a valid order parked, an injected
    /// one reserved).
    pub unexpected: usize,
    /// Reserved more than once.
    pub duplicated: usize,
    /// The lost orders by where they were placed: in the first, middle or last third of
    /// the run (a loss at the tail points at shutdown or the final drain, one in the
    /// middle at a fault).
    pub lost_at: Thirds,
    /// DLQ entries beyond one per published copy of an injected order: dead letters sent
    /// again after their confirm was lost, or parked again by the next owner.
    pub extra_dead_letters: usize,
}

/// Counts by the third of a run an order was placed in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Thirds {
    /// Placed in the first third.
    pub early: usize,
    /// Placed in the middle third.
    pub middle: usize,
    /// Placed in the last third.
    pub tail: usize,
}

impl Thirds {
    /// Count the order placed `index`-th of `total`.
    fn count(&mut self, index: usize, total: usize) {
        match index.saturating_mul(3) / total.max(1) {
            0 => self.early += 1,
            1 => self.middle += 1,
            _ => self.tail += 1,
        }
    }
}

impl Outcomes {
    fn sort(
        expected: &Expected,
        reservations: &HashMap<String, i64>,
        dlq: &HashMap<MessageId, Vec<reliq_core::DeadLetterReason>>,
        events: &Events,
    ) -> Self {
        let absorbed: HashSet<MessageId> = events
            .all()
            .into_iter()
            .filter_map(|(_, e)| match e {
                Event::Duplicate(id) => Some(id),
                _ => None,
            })
            .collect();
        let mut o = Self::default();
        let total = expected.placed.len();
        for (index, id) in expected.placed.iter().enumerate() {
            let lost = if expected.valid.contains_key(id) {
                match reservations.get(id.as_str()).copied().unwrap_or(0) {
                    0 => true,
                    1 if absorbed.contains(id) => {
                        o.recovered += 1;
                        false
                    }
                    1 => {
                        o.once += 1;
                        false
                    }
                    _ => {
                        o.duplicated += 1;
                        false
                    }
                }
            } else {
                match dlq.get(id).map_or(0, Vec::len) {
                    0 => true,
                    entries => {
                        o.extra_dead_letters += entries - 1;
                        o.once += 1;
                        false
                    }
                }
            };
            if lost {
                o.lost += 1;
                o.lost_at.count(index, total);
            }
        }
        let placed = |id: &str| expected.valid.contains_key(&MessageId::from(id.to_owned()));
        o.unexpected = reservations.keys().filter(|id| !placed(id)).count()
            + dlq
                .keys()
                .filter(|id| !expected.dead.contains_key(*id))
                .count();
        o
    }
}

impl std::fmt::Display for Outcomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "once={} recovered={} lost={} (early/middle/tail {}/{}/{}) unexpected={} duplicated={} \
             extra_dead_letters={}",
            self.once,
            self.recovered,
            self.lost,
            self.lost_at.early,
            self.lost_at.middle,
            self.lost_at.tail,
            self.unexpected,
            self.duplicated,
            self.extra_dead_letters
        )
    }
}

/// `rows` (id → row count) has exactly the ids of `want`, each once.
fn exactly_once(
    what: &str,
    want: &HashSet<&str>,
    rows: &HashMap<String, i64>,
) -> anyhow::Result<()> {
    let missing = want.iter().filter(|id| !rows.contains_key(**id)).count();
    let extra: Vec<_> = rows
        .keys()
        .filter(|id| !want.contains(id.as_str()))
        .collect();
    let doubled: Vec<_> = rows.iter().filter(|(_, n)| **n != 1).collect();
    ensure!(
        missing == 0 && extra.is_empty() && doubled.is_empty(),
        "{what}: {missing} valid orders missing (lost), {} not valid ({extra:?}), {} not exactly once ({doubled:?})",
        extra.len(),
        doubled.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_the_child_s_stdout() {
        let stats = StatsSnapshot {
            received: 9,
            processed: 8,
            retried: 7,
            dead_lettered: 6,
            duplicates: 5,
            in_flight: 4,
            settle_failures: 3,
            released: 2,
            ..StatsSnapshot::default()
        };
        for e in [
            Event::Ready,
            Event::Clock(-1_765_000_000_000),
            Event::CommitAck(MessageId::from("m-1".to_owned())),
            Event::Duplicate(MessageId::from("m-2".to_owned())),
            Event::Stats(stats),
        ] {
            assert_eq!(Event::parse(&e.line()), Some(e.clone()), "{}", e.line());
        }
        assert_eq!(Event::parse("stats 1 2 3"), None);
    }

    #[test]
    fn every_order_is_sorted_by_what_became_of_it() {
        let id = |s: &str| MessageId::from(s.to_owned());
        let mut expected = Expected::default();
        for v in ["a", "b", "c", "e"] {
            expected.valid.insert(id(v), ("sku-1".into(), 1));
        }
        for d in ["p", "q", "r"] {
            expected
                .dead
                .insert(id(d), reliq_core::DeadLetterReason::Poison);
        }
        expected.dead_copies.insert(id("r"));
        // Placed: c and q in the first third, p and r in the middle one.
        expected.placed = ["c", "q", "a", "p", "r", "b", "e"].map(id).to_vec();
        let reservations: HashMap<String, i64> = [("a", 1), ("b", 2), ("e", 1), ("x", 1)]
            .map(|(k, n)| (k.to_owned(), n))
            .into();
        let poison = reliq_core::DeadLetterReason::Poison;
        let dlq = HashMap::from([
            (id("p"), vec![poison; 3]),
            (id("r"), vec![poison; 3]),
            (id("e"), vec![reliq_core::DeadLetterReason::Permanent]),
        ]);
        let events = Events::default();
        events.push(1, Event::Duplicate(id("a")));
        let o = Outcomes::sort(&expected, &reservations, &dlq, &events);
        assert_eq!(
            o,
            Outcomes {
                once: 3,       // e reserved; p and r parked
                recovered: 1,  // a, delivered again
                lost: 2,       // c never reserved, q never parked
                unexpected: 2, // x reserved, e (valid) parked
                duplicated: 1, // b
                lost_at: Thirds {
                    early: 2, // c and q
                    middle: 0,
                    tail: 0,
                },
                extra_dead_letters: 4, // p and r: 3 entries each for one dead letter
            }
        );
        let mut thirds = Thirds::default();
        for index in 0..9 {
            thirds.count(index, 9);
        }
        assert_eq!(
            thirds,
            Thirds {
                early: 3,
                middle: 3,
                tail: 3
            }
        );
    }

    fn shell_runner(script: &str, until: &Until) -> ChildRunner {
        ChildRunner {
            exe: "/bin/sh".into(),
            netns: None,
            args: vec!["-c".into(), script.into()],
            env: Vec::new(),
            events: Events::default(),
            run: 0,
            child: None,
            exited: until.consumer_exited.clone(),
        }
    }

    fn until_in(secs: u64) -> Until {
        Until {
            deadline: Instant::now() + Duration::from_secs(secs),
            fault_failed: Arc::default(),
            consumer_exited: Arc::default(),
        }
    }

    /// A restarted consumer that exits (a failed subscribe) ends the driver's wait at once
    /// with what happened, instead of at the run's deadline.
    #[tokio::test]
    async fn a_consumer_that_exits_on_its_own_ends_the_wait() -> anyhow::Result<()> {
        let until = until_in(60);
        let mut runner = shell_runner("exit 3", &until);
        runner.start(2, None).await?;
        let started = Instant::now();
        let err = wait_for("a restarted consumer", &until, async || Ok(None::<()>))
            .await
            .expect_err("the wait must fail");
        assert!(
            format!("{err:#}").contains("consumer run 2 exited on its own"),
            "{err:#}"
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        Ok(())
    }

    /// Killed or stopped by the driver, a consumer's end is expected.
    #[tokio::test]
    async fn a_consumer_the_driver_ends_is_not_reported() -> anyhow::Result<()> {
        let until = until_in(60);
        let mut runner = shell_runner("exec sleep 30", &until);
        runner.start(0, None).await?;
        assert_eq!(runner.kill().await?, "SIGKILL");
        let mut runner = shell_runner("cat >/dev/null", &until);
        runner.start(1, None).await?;
        runner.stop().await?;
        // The output readers have seen both ends by now.
        tokio::time::sleep(Duration::from_millis(200)).await;
        until.check("nothing")?;
        Ok(())
    }
}

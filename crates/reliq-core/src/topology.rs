use std::fmt;

use serde::Serialize;
use serde_json::Value;

/// How much a difference matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Throughput, naming, tidiness: the contract still holds.
    Cosmetic,
    /// A message can be lost, dead-lettered early, redelivered forever or delivered where
    /// it should not be: the contract does not hold.
    Breaking,
}

impl Severity {
    /// `cosmetic` or `breaking` (the metric label and the JSON value).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cosmetic => "cosmetic",
            Self::Breaking => "breaking",
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cosmetic => "cosmetic",
            Self::Breaking => "breaks delivery guarantees",
        })
    }
}

/// What kind of broker object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectKind {
    /// A RabbitMQ exchange.
    Exchange,
    /// A queue (RabbitMQ, SQS, the embedded broker).
    Queue,
    /// A stream (RabbitMQ streams, JetStream streams).
    Stream,
    /// A RabbitMQ binding.
    Binding,
    /// A RabbitMQ policy.
    Policy,
    /// A Kafka topic.
    Topic,
    /// A Kafka consumer group.
    ConsumerGroup,
    /// A JetStream consumer.
    Consumer,
}

impl ObjectKind {
    /// The kind as a word (`consumer_group` → `consumer group`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exchange => "exchange",
            Self::Queue => "queue",
            Self::Stream => "stream",
            Self::Binding => "binding",
            Self::Policy => "policy",
            Self::Topic => "topic",
            Self::ConsumerGroup => "consumer group",
            Self::Consumer => "consumer",
        }
    }
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The value a setting must have.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "is", content = "value", rename_all = "snake_case")]
pub enum Wanted {
    /// Exactly this value (numbers and their decimal text compare equal: brokers that
    /// report every setting as text need no special case).
    Equals(Value),
    /// A number at least this large; `-1` found means unlimited (Kafka's retention) and
    /// satisfies any bound.
    AtLeast(i64),
    /// A list that holds at least these values (in any order, others allowed).
    Includes(Vec<Value>),
    /// Not set at all: a setting reliq does not use and that would change what the
    /// object does to messages (a length limit, a TTL on a consumer queue).
    Unset,
}

impl Wanted {
    /// `Equals` of anything JSON can hold.
    pub fn equals(value: impl Into<Value>) -> Self {
        Self::Equals(value.into())
    }

    /// `Includes` of these strings.
    pub fn includes<S: Into<String>>(values: impl IntoIterator<Item = S>) -> Self {
        Self::Includes(
            values
                .into_iter()
                .map(|v| Value::String(v.into()))
                .collect(),
        )
    }

    /// Whether `found` (`None` = not set) satisfies this.
    pub fn holds(&self, found: Option<&Value>) -> bool {
        match (self, found) {
            (Self::Unset, found) => found.is_none_or(Value::is_null),
            (_, None) => false,
            (Self::Equals(want), Some(found)) => same(want, found),
            (Self::AtLeast(min), Some(found)) => {
                number(found).is_some_and(|n| n == -1 || n >= *min)
            }
            (Self::Includes(want), Some(Value::Array(found))) => {
                want.iter().all(|w| found.iter().any(|f| same(w, f)))
            }
            (Self::Includes(_), Some(_)) => false,
        }
    }
}

impl fmt::Display for Wanted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Equals(v) => write!(f, "= {}", show(v)),
            Self::AtLeast(n) => write!(f, "≥ {n}"),
            Self::Includes(vs) => {
                let vs: Vec<String> = vs.iter().map(show).collect();
                write!(f, "includes {}", vs.join(", "))
            }
            Self::Unset => f.write_str("unset"),
        }
    }
}

fn number(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn same(a: &Value, b: &Value) -> bool {
    if a == b {
        return true;
    }
    match (a, b) {
        (Value::Number(_), Value::String(_)) | (Value::String(_), Value::Number(_)) => {
            number(a).is_some() && number(a) == number(b)
        }
        (Value::Bool(x), Value::String(s)) | (Value::String(s), Value::Bool(x)) => s
            .trim()
            .eq_ignore_ascii_case(if *x { "true" } else { "false" }),
        _ => false,
    }
}

/// A value as an operator would type it: strings without quotes.
fn show(v: &Value) -> String {
    match v {
        Value::String(s) if s.is_empty() => "\"\"".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A duration as settings compare it: `30s`, `1m 30s`, `0s` (humantime's text).
pub fn duration_text(d: std::time::Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// One setting of a planned object.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Setting {
    /// The broker's own name for it (`x-delivery-limit`, `retention.ms`, `max_deliver`,
    /// `RedrivePolicy.maxReceiveCount`).
    pub key: String,
    /// What it must be.
    pub wanted: Wanted,
    /// How much it matters when it is not.
    pub severity: Severity,
    /// What goes wrong when it is not, in a sentence.
    pub why: String,
}

/// One broker object the consumer needs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlannedObject {
    /// What kind of object.
    pub kind: ObjectKind,
    /// Its name (a binding: `<exchange> -> <queue> key=<key>`).
    pub name: String,
    /// What it is for (`consumer queue`, `retry tier 5s`, `the DLQ`).
    pub role: String,
    /// How much it matters when it does not exist; `None` when its absence is no
    /// difference (the broker makes it when it is first used: a Kafka group).
    pub missing: Option<Severity>,
    /// The settings checked.
    pub settings: Vec<Setting>,
    /// The messages it holds, when it is one of the consumer's channels (the source, a
    /// retry tier, the DLQ; a JetStream source stream holds the retries too): what the
    /// AsyncAPI document describes.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub channels: Vec<Channel>,
}

impl PlannedObject {
    /// An object whose absence breaks the contract, with no settings yet.
    pub fn new(kind: ObjectKind, name: impl Into<String>, role: impl Into<String>) -> Self {
        Self {
            kind,
            name: name.into(),
            role: role.into(),
            missing: Some(Severity::Breaking),
            settings: Vec::new(),
            channels: Vec::new(),
        }
    }

    /// It holds messages: `channel` says which and how producers address them.
    pub fn carrying(mut self, channel: Channel) -> Self {
        self.channels.push(channel);
        self
    }

    /// Its absence is no difference: the broker makes it when it is first used (and may
    /// drop it when unused, as Kafka drops an empty group that never committed).
    pub fn made_on_first_use(mut self) -> Self {
        self.missing = None;
        self
    }

    /// With a setting.
    pub fn with(
        mut self,
        key: impl Into<String>,
        wanted: Wanted,
        severity: Severity,
        why: impl Into<String>,
    ) -> Self {
        self.settings.push(Setting {
            key: key.into(),
            wanted,
            severity,
            why: why.into(),
        });
        self
    }
}

/// Which of a consumer's messages a [`Channel`] holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "holds", rename_all = "snake_case")]
pub enum Traffic {
    /// What producers publish and the consumer reads.
    Source,
    /// Retry copies waiting out these delays, in milliseconds (one per tier where each
    /// tier has its own object; every tier where they share one).
    Retry {
        /// The delays of the copies it holds.
        delays_ms: Vec<u64>,
    },
    /// The dead-letter records of the consumer's DLQ.
    DeadLetters,
}

impl Traffic {
    /// Retry copies waiting out `delays`.
    pub fn retry(delays: impl IntoIterator<Item = std::time::Duration>) -> Self {
        Self::Retry {
            delays_ms: delays
                .into_iter()
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                .collect(),
        }
    }
}

/// A planned object that holds messages, as a channel of the consumer's AsyncAPI
/// document: what it holds, the address producers use, and the broker's own description
/// of it (AsyncAPI's protocol bindings).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Channel {
    /// What it holds.
    #[serde(flatten)]
    pub traffic: Traffic,
    /// Where a producer sends to it: the topic, queue, subject or routing key.
    pub address: String,
    /// AsyncAPI channel bindings by protocol (`{"kafka": {"topic": …}}`).
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub bindings: serde_json::Map<String, Value>,
    /// AsyncAPI bindings of the operation that reads it (a Kafka `groupId`).
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub read_bindings: serde_json::Map<String, Value>,
}

impl Channel {
    /// A channel holding `traffic` at `address`, without bindings.
    pub fn new(traffic: Traffic, address: impl Into<String>) -> Self {
        Self {
            traffic,
            address: address.into(),
            bindings: serde_json::Map::new(),
            read_bindings: serde_json::Map::new(),
        }
    }

    /// With the channel binding of `protocol` (`kafka`, `amqp`, `nats`, `sqs`).
    pub fn binding(mut self, protocol: &str, binding: Value) -> Self {
        self.bindings.insert(protocol.to_owned(), binding);
        self
    }

    /// With the binding of `protocol` for the operation that reads it.
    pub fn read_binding(mut self, protocol: &str, binding: Value) -> Self {
        self.read_bindings.insert(protocol.to_owned(), binding);
        self
    }
}

/// What a consumer with one subscription needs at the broker.
///
/// A consumer's topology as data: what it needs at the broker ([`Plan`], from
/// [`Broker::plan`]), what the broker has ([`LiveTopology`], from [`Broker::inspect`]), and
/// every difference between the two ([`Drift`], from [`compare`] or
/// [`Broker::check_topology`]).
///
/// A consumer's guarantees live in broker objects that others can change: an operator
/// policy that replaces the delivery limit, a retry topic created by hand with a retention
/// shorter than its tier, a JetStream consumer edited to another `max_deliver`, an SQS
/// redrive policy pointing at another queue, or the retry tiers of an earlier policy still
/// holding messages. The plan names each object and each setting that matters, with how
/// much it matters when it is not as planned ([`Severity`]); the backend reads the live
/// objects and says who set each value ([`Found::set_by`]: a policy, a broker default), and
/// the comparison here is the same for every broker.
///
/// [`Broker::plan`]: crate::broker::Broker::plan
/// [`Broker::inspect`]: crate::broker::Broker::inspect
/// [`Broker::check_topology`]: crate::broker::Broker::check_topology
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// The backend ([`Broker::kind`](crate::broker::Broker::kind)).
    pub backend: String,
    /// The consumer (group).
    pub consumer: String,
    /// What it consumes.
    pub source: String,
    /// The objects, in the order the backend declares them.
    pub objects: Vec<PlannedObject>,
    /// What this backend does not check, and why (printed with the plan).
    pub unchecked: Vec<String>,
}

impl Plan {
    /// An empty plan for `subscription` on `backend`.
    pub fn new(backend: &str, subscription: &crate::subscription::Subscription) -> Self {
        Self {
            backend: backend.to_owned(),
            consumer: subscription.consumer.clone(),
            source: subscription.source.clone(),
            objects: Vec::new(),
            unchecked: Vec::new(),
        }
    }

    /// With an object.
    pub fn with(mut self, object: PlannedObject) -> Self {
        self.objects.push(object);
        self
    }

    /// With a note on what is not checked.
    pub fn not_checking(mut self, what: impl Into<String>) -> Self {
        self.unchecked.push(what.into());
        self
    }

    /// The planned object of `kind` named `name`.
    pub fn object(&self, kind: ObjectKind, name: &str) -> Option<&PlannedObject> {
        self.objects
            .iter()
            .find(|o| o.kind == kind && o.name == name)
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "# reliq topology of consumer `{}` on `{}` ({})",
            self.consumer, self.source, self.backend
        )?;
        for o in &self.objects {
            let made = if o.missing.is_none() {
                ", made on first use"
            } else {
                ""
            };
            writeln!(f, "{} {}  ({}{made})", o.kind, o.name, o.role)?;
            for s in &o.settings {
                let mark = match s.severity {
                    Severity::Breaking => "!",
                    Severity::Cosmetic => " ",
                };
                writeln!(f, "  {mark} {} {}", s.key, s.wanted)?;
            }
        }
        writeln!(f, "# ! = breaks delivery guarantees when different")?;
        for u in &self.unchecked {
            writeln!(f, "# not checked: {u}")?;
        }
        Ok(())
    }
}

/// A setting's value on the broker.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Found {
    /// The value in effect.
    pub value: Value,
    /// Who set it, where that is not the object itself: `policy ops-limits`, `operator
    /// policy cap`, `broker default`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub set_by: Option<String>,
}

impl Found {
    /// A value the object itself carries.
    pub fn own(value: impl Into<Value>) -> Self {
        Self {
            value: value.into(),
            set_by: None,
        }
    }

    /// A value set by `by`.
    pub fn set_by(value: impl Into<Value>, by: impl Into<String>) -> Self {
        Self {
            value: value.into(),
            set_by: Some(by.into()),
        }
    }
}

/// A planned object as the broker has it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LiveObject {
    /// The settings in effect, by the plan's keys; a key absent here is not set. A
    /// setting a backend cannot read is left out of the plan, not reported unset.
    pub settings: Vec<(String, Found)>,
    /// Who decides the settings an object does not carry itself, when it is not the
    /// object (e.g. the RabbitMQ policy that applies): named in a difference with no
    /// [`Found`] of its own.
    pub governed_by: Option<String>,
}

impl LiveObject {
    /// With a setting in effect.
    pub fn with(mut self, key: impl Into<String>, found: Found) -> Self {
        self.settings.push((key.into(), found));
        self
    }

    fn get(&self, key: &str) -> Option<&Found> {
        self.settings.iter().find(|(k, _)| k == key).map(|(_, f)| f)
    }
}

/// An object on the broker that belongs to this consumer by its name and that the plan
/// does not have: the retry tier of an earlier policy, most often.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExtraObject {
    /// What kind of object.
    pub kind: ObjectKind,
    /// Its name.
    pub name: String,
    /// Messages it holds, where the broker says.
    pub messages: Option<u64>,
    /// Breaking when what it holds is stranded (nothing will deliver it); cosmetic when
    /// empty or when the broker still drains it.
    pub severity: Severity,
    /// What happens to what it holds.
    pub note: String,
}

/// What the broker has for a plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LiveTopology {
    /// The planned objects that exist, by `(kind, name)`.
    pub objects: Vec<(ObjectKind, String, LiveObject)>,
    /// Objects of this consumer the plan does not have.
    pub extra: Vec<ExtraObject>,
}

impl LiveTopology {
    /// With a planned object found.
    pub fn found(mut self, kind: ObjectKind, name: impl Into<String>, live: LiveObject) -> Self {
        self.objects.push((kind, name.into(), live));
        self
    }

    /// Record a planned object found.
    pub fn push(&mut self, kind: ObjectKind, name: impl Into<String>, live: LiveObject) {
        self.objects.push((kind, name.into(), live));
    }

    fn get(&self, kind: ObjectKind, name: &str) -> Option<&LiveObject> {
        self.objects
            .iter()
            .find(|(k, n, _)| *k == kind && n == name)
            .map(|(_, _, o)| o)
    }
}

/// How the broker differs from the plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "difference", rename_all = "snake_case")]
pub enum Difference {
    /// The object does not exist.
    Missing {
        /// What it is for.
        role: String,
    },
    /// The object exists and the plan does not have it.
    Extra {
        /// Messages it holds, where the broker says.
        messages: Option<u64>,
        /// What happens to them.
        note: String,
    },
    /// A setting is not as planned.
    Different {
        /// The setting.
        setting: String,
        /// What it must be.
        wanted: Wanted,
        /// What it is (`None`: not set).
        found: Option<Value>,
        /// Who set the value found, or who decides it when it is not set.
        set_by: Option<String>,
        /// What goes wrong.
        why: String,
    },
}

/// One difference between the plan and the broker.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Drift {
    /// The object's kind.
    pub kind: ObjectKind,
    /// The object's name.
    pub object: String,
    /// How much it matters.
    pub severity: Severity,
    /// What differs.
    #[serde(flatten)]
    pub difference: Difference,
}

impl Drift {
    /// The setting that differs, if it is a setting.
    pub fn setting(&self) -> Option<&str> {
        match &self.difference {
            Difference::Different { setting, .. } => Some(setting),
            _ => None,
        }
    }
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} `{}`: ", self.severity, self.kind, self.object)?;
        match &self.difference {
            Difference::Missing { role } => write!(f, "missing ({role})"),
            Difference::Extra { messages, note } => {
                f.write_str("not in the plan")?;
                if let Some(n) = messages {
                    write!(f, ", holds {n} message{}", if *n == 1 { "" } else { "s" })?;
                }
                write!(f, " — {note}")
            }
            Difference::Different {
                setting,
                wanted,
                found,
                set_by,
                why,
            } => {
                write!(f, "{setting} wanted {wanted}, found ")?;
                match found {
                    Some(v) => f.write_str(&show(v))?,
                    None => f.write_str("unset")?,
                }
                if let Some(by) = set_by {
                    write!(f, " ({by})")?;
                }
                write!(f, " — {why}")
            }
        }
    }
}

/// Every difference between `plan` and `live`: missing objects, settings not as wanted
/// (with who set them), extra objects. Breaking ones first, then in plan order.
pub fn compare(plan: &Plan, live: &LiveTopology) -> Vec<Drift> {
    let mut drift = Vec::new();
    for o in &plan.objects {
        let Some(found) = live.get(o.kind, &o.name) else {
            if let Some(severity) = o.missing {
                drift.push(Drift {
                    kind: o.kind,
                    object: o.name.clone(),
                    severity,
                    difference: Difference::Missing {
                        role: o.role.clone(),
                    },
                });
            }
            continue;
        };
        for s in &o.settings {
            let value = found.get(&s.key);
            if s.wanted.holds(value.map(|f| &f.value)) {
                continue;
            }
            drift.push(Drift {
                kind: o.kind,
                object: o.name.clone(),
                severity: s.severity,
                difference: Difference::Different {
                    setting: s.key.clone(),
                    wanted: s.wanted.clone(),
                    found: value.map(|f| f.value.clone()),
                    set_by: value
                        .and_then(|f| f.set_by.clone())
                        .or_else(|| found.governed_by.clone()),
                    why: s.why.clone(),
                },
            });
        }
    }
    for e in &live.extra {
        drift.push(Drift {
            kind: e.kind,
            object: e.name.clone(),
            severity: e.severity,
            difference: Difference::Extra {
                messages: e.messages,
                note: e.note.clone(),
            },
        });
    }
    // Stable: plan order within each severity.
    drift.sort_by_key(|d| std::cmp::Reverse(d.severity));
    drift
}

/// A plan and the differences the broker has from it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopologyReport {
    /// What the consumer needs.
    pub plan: Plan,
    /// How the broker differs (empty: as planned).
    pub drift: Vec<Drift>,
}

impl TopologyReport {
    /// Compare `live` with `plan`.
    pub fn new(plan: Plan, live: &LiveTopology) -> Self {
        let drift = compare(&plan, live);
        Self { plan, drift }
    }

    /// Whether any difference breaks delivery guarantees.
    pub fn is_breaking(&self) -> bool {
        self.drift.iter().any(|d| d.severity == Severity::Breaking)
    }

    /// How many differences have `severity`.
    pub fn count(&self, severity: Severity) -> usize {
        self.drift.iter().filter(|d| d.severity == severity).count()
    }

    /// Set `reliq_topology_drift{consumer, source, severity}` to the differences found.
    pub fn record(&self) {
        for severity in [Severity::Breaking, Severity::Cosmetic] {
            metrics::gauge!(crate::telemetry::TOPOLOGY_DRIFT,
                "consumer" => self.plan.consumer.clone(),
                "source" => self.plan.source.clone(),
                "severity" => severity.as_str())
            .set(self.count(severity) as f64);
        }
    }
}

impl fmt::Display for TopologyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.drift.is_empty() {
            return writeln!(
                f,
                "consumer `{}` on `{}` ({}): the broker has the topology as planned ({} objects)",
                self.plan.consumer,
                self.plan.source,
                self.plan.backend,
                self.plan.objects.len()
            );
        }
        writeln!(
            f,
            "consumer `{}` on `{}` ({}): {} breaking, {} cosmetic difference(s)",
            self.plan.consumer,
            self.plan.source,
            self.plan.backend,
            self.count(Severity::Breaking),
            self.count(Severity::Cosmetic)
        )?;
        for d in &self.drift {
            writeln!(f, "- {d}")?;
        }
        Ok(())
    }
}

/// What a consumer does with the topology check at start-up
/// ([`ConsumerBuilder::check_topology`](crate::consumer::ConsumerBuilder::check_topology)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StartupCheck {
    /// No check (the default: on RabbitMQ it needs the management API).
    #[default]
    Off,
    /// Log each difference (breaking ones as errors) and start anyway; a check that
    /// cannot run is logged too.
    Warn,
    /// Refuse to start on a breaking difference, or when the check cannot run.
    Refuse,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::subscription::Subscription;
    use serde_json::json;

    fn plan() -> Plan {
        Plan::new("test", &Subscription::new("billing", "orders"))
            .with(
                PlannedObject::new(ObjectKind::Queue, "orders.billing", "consumer queue")
                    .with(
                        "delivery-limit",
                        Wanted::equals(4),
                        Severity::Breaking,
                        "crash loops",
                    )
                    .with("max-length", Wanted::Unset, Severity::Breaking, "drops")
                    .with("partitions", Wanted::equals(3), Severity::Cosmetic, "speed"),
            )
            .with(
                PlannedObject::new(ObjectKind::Topic, "orders.billing.retry.5000ms", "tier").with(
                    "retention.ms",
                    Wanted::AtLeast(5000),
                    Severity::Breaking,
                    "lost",
                ),
            )
            .with(
                PlannedObject::new(ObjectKind::ConsumerGroup, "billing", "group")
                    .made_on_first_use(),
            )
    }

    #[test]
    fn as_planned_is_no_drift() {
        let live = LiveTopology::default()
            .found(
                ObjectKind::Queue,
                "orders.billing",
                LiveObject::default()
                    .with("delivery-limit", Found::own("4"))
                    .with("partitions", Found::own(3)),
            )
            .found(
                ObjectKind::Topic,
                "orders.billing.retry.5000ms",
                LiveObject::default().with("retention.ms", Found::own("-1")),
            )
            .found(ObjectKind::ConsumerGroup, "billing", LiveObject::default());
        assert_eq!(compare(&plan(), &live), vec![]);
    }

    #[test]
    fn each_difference_is_named_with_who_set_it_breaking_first() {
        let live = LiveTopology {
            objects: vec![(
                ObjectKind::Queue,
                "orders.billing".into(),
                LiveObject {
                    settings: vec![
                        (
                            "delivery-limit".into(),
                            Found::set_by(1, "operator policy cap"),
                        ),
                        ("partitions".into(), Found::own(1)),
                        ("max-length".into(), Found::set_by(10, "policy ops")),
                    ],
                    governed_by: None,
                },
            )],
            extra: vec![ExtraObject {
                kind: ObjectKind::Topic,
                name: "orders.billing.retry.1000ms".into(),
                messages: Some(3),
                severity: Severity::Cosmetic,
                note: "drained".into(),
            }],
        };
        let drift = compare(&plan(), &live);
        let lines: Vec<String> = drift.iter().map(ToString::to_string).collect();
        assert_eq!(
            lines,
            vec![
                "breaks delivery guarantees: queue `orders.billing`: delivery-limit wanted = 4, found 1 (operator policy cap) — crash loops",
                "breaks delivery guarantees: queue `orders.billing`: max-length wanted unset, found 10 (policy ops) — drops",
                "breaks delivery guarantees: topic `orders.billing.retry.5000ms`: missing (tier)",
                "cosmetic: queue `orders.billing`: partitions wanted = 3, found 1 — speed",
                "cosmetic: topic `orders.billing.retry.1000ms`: not in the plan, holds 3 messages — drained",
            ]
        );
        let report = TopologyReport {
            plan: plan(),
            drift,
        };
        assert!(report.is_breaking());
        assert_eq!(report.count(Severity::Cosmetic), 2);
        let doc = serde_json::to_value(&report).unwrap();
        assert_eq!(doc["drift"][0]["difference"], "different");
        assert_eq!(doc["drift"][0]["severity"], "breaking");
        assert_eq!(
            doc["drift"][0]["wanted"],
            json!({"is": "equals", "value": 4})
        );
        assert_eq!(doc["drift"][0]["set_by"], "operator policy cap");
        assert_eq!(doc["drift"][4]["messages"], 3);
    }

    #[test]
    fn wanted_values() {
        assert!(Wanted::AtLeast(10).holds(Some(&json!(-1))));
        assert!(!Wanted::AtLeast(10).holds(Some(&json!("9"))));
        assert!(Wanted::equals(true).holds(Some(&json!("true"))));
        assert!(!Wanted::equals("a").holds(None));
        assert!(Wanted::includes(["a", "b"]).holds(Some(&json!(["b", "c", "a"]))));
        assert!(!Wanted::includes(["a", "b"]).holds(Some(&json!(["a"]))));
        assert!(Wanted::Unset.holds(Some(&Value::Null)));
    }

    #[test]
    fn plan_prints_objects_and_what_is_not_checked() {
        let text = plan().not_checking("broker ACLs").to_string();
        assert!(
            text.contains("queue orders.billing  (consumer queue)\n  ! delivery-limit = 4\n"),
            "{text}"
        );
        assert!(text.contains("    partitions = 3\n"), "{text}");
        assert!(text.contains("  ! retention.ms ≥ 5000\n"), "{text}");
        assert!(
            text.contains("consumer group billing  (group, made on first use)\n"),
            "{text}"
        );
        assert!(text.contains("# not checked: broker ACLs"));
    }
}

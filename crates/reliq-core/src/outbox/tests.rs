//! The relay against an in-memory store with the SQL stores' lease rules.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use super::*;
use crate::broker::{Broker, Receiver};
use crate::error::BrokerError;
use crate::message::MessageId;
use crate::subscription::{Capabilities, Subscription};

/// An in-memory store with the same lease rules as the SQL ones.
#[derive(Default)]
struct TestStore {
    rows: Mutex<BTreeMap<i64, Row>>,
}

struct Row {
    record: OutboxRecord,
    sent: bool,
    lease: Option<(String, Instant)>,
    last_error: Option<String>,
}

impl TestStore {
    fn add(&self, seq: i64, topic: &str, id: &str) {
        let record = OutboxRecord {
            seq,
            destination: Destination::new(topic),
            message: Message::with_id_and_payload(id, "x"),
        };
        self.rows.lock().unwrap().insert(
            seq,
            Row {
                record,
                sent: false,
                lease: None,
                last_error: None,
            },
        );
    }
    fn unsent(&self) -> Vec<i64> {
        let rows = self.rows.lock().unwrap();
        rows.iter()
            .filter(|(_, r)| !r.sent)
            .map(|(s, _)| *s)
            .collect()
    }
    fn last_error(&self, seq: i64) -> Option<String> {
        self.rows.lock().unwrap()[&seq].last_error.clone()
    }
}

#[async_trait]
impl OutboxStore for TestStore {
    async fn claim_batch(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRecord>, OutboxError> {
        let now = Instant::now();
        let mut rows = self.rows.lock().unwrap();
        let mut out = Vec::new();
        for row in rows.values_mut() {
            let free = row.lease.as_ref().is_none_or(|(_, until)| *until <= now);
            if !row.sent && free && out.len() < limit {
                row.lease = Some((owner.to_owned(), now + lease));
                out.push(row.record.clone());
            }
        }
        Ok(out)
    }
    async fn mark_sent(&self, _owner: &str, seqs: &[i64]) -> Result<(), OutboxError> {
        let mut rows = self.rows.lock().unwrap();
        for s in seqs {
            if let Some(r) = rows.get_mut(s) {
                r.sent = true;
                r.lease = None;
            }
        }
        Ok(())
    }
    async fn release(&self, owner: &str, seqs: &[i64], error: &str) -> Result<(), OutboxError> {
        let mut rows = self.rows.lock().unwrap();
        for s in seqs {
            if let Some(r) = rows.get_mut(s)
                && r.lease.as_ref().is_some_and(|(o, _)| o == owner)
            {
                r.lease = None;
                r.last_error = Some(error.to_owned());
            }
        }
        Ok(())
    }
}

/// Records what it confirmed; refuses topics it does not know.
#[derive(Default)]
struct TestBroker {
    topics: Mutex<Vec<String>>,
    published: Mutex<Vec<MessageId>>,
}

#[async_trait]
impl Broker for TestBroker {
    fn kind(&self) -> &'static str {
        "test"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
    async fn publish(&self, d: &Destination, m: Message) -> Result<(), BrokerError> {
        if !self.topics.lock().unwrap().contains(&d.topic) {
            return Err(BrokerError::Unroutable(d.topic.clone()));
        }
        self.published.lock().unwrap().push(m.id().clone());
        Ok(())
    }
    async fn subscribe(&self, _: &Subscription) -> Result<Box<dyn Receiver>, BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "test",
            what: "subscribe",
        })
    }
    async fn dead_letters(
        &self,
        _: &Subscription,
    ) -> Result<Box<dyn crate::dead_letters::DeadLetters>, BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "test",
            what: "dead_letters",
        })
    }
    async fn ping(&self) -> Result<(), BrokerError> {
        Ok(())
    }
    async fn backlog(&self, _: &Subscription) -> Result<crate::backlog::Backlog, BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "test",
            what: "backlog",
        })
    }

    async fn plan(&self, _: &Subscription) -> Result<crate::topology::Plan, BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "test",
            what: "plan",
        })
    }

    async fn inspect(
        &self,
        _: &Subscription,
        _: &crate::topology::Plan,
    ) -> Result<crate::topology::LiveTopology, BrokerError> {
        Err(BrokerError::Unsupported {
            backend: "test",
            what: "inspect",
        })
    }
}

fn ids(b: &TestBroker) -> Vec<String> {
    let p = b.published.lock().unwrap();
    p.iter().map(|i| i.as_str().to_owned()).collect()
}

#[tokio::test(start_paused = true)]
async fn publishes_in_order_and_stops_at_the_first_failure() {
    let store = Arc::new(TestStore::default());
    let broker = Arc::new(TestBroker::default());
    broker.topics.lock().unwrap().push("good".into());
    store.add(1, "good", "a");
    store.add(2, "good", "b");
    store.add(3, "missing", "c");
    store.add(4, "good", "d");
    let relay = Relay::builder(store.clone(), broker.clone())
        .batch_size(10)
        .build()
        .unwrap();
    let err = relay.run_once().await.unwrap_err();
    assert!(matches!(err, RelayError::Publish { seq: 3, .. }), "{err}");
    assert_eq!(ids(&broker), ["a", "b"]);
    // The failed row and the one behind it are kept, released, with the error.
    assert_eq!(store.unsent(), [3, 4]);
    assert!(store.last_error(3).unwrap().contains("unroutable"));
    let s = relay.stats();
    assert_eq!((s.published, s.publish_failures, s.batches), (2, 1, 1));

    // Repair the route: the next round publishes the rest, in order.
    broker.topics.lock().unwrap().push("missing".into());
    assert_eq!(relay.run_once().await.unwrap(), 2);
    assert_eq!(ids(&broker), ["a", "b", "c", "d"]);
    assert!(store.unsent().is_empty());
    assert_eq!(relay.run_once().await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_running_relay_backs_off_on_failure_and_catches_up() {
    let store = Arc::new(TestStore::default());
    let broker = Arc::new(TestBroker::default());
    store.add(1, "t", "a");
    let handle = Relay::builder(store.clone(), broker.clone())
        .backoff(Duration::from_secs(1), Duration::from_secs(4))
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap()
        .start();
    tokio::time::sleep(Duration::from_secs(20)).await;
    // Backing off 1 s, 2 s, 4 s, 4 s … (plus jitter below the delay): a handful of
    // tries in 20 s, not a hot loop.
    let failures = handle.stats().publish_failures;
    assert!((3..=12).contains(&failures), "{failures} failures");
    assert_eq!(store.unsent(), [1]);
    broker.topics.lock().unwrap().push("t".into());
    store.add(2, "t", "b");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let stats = handle.shutdown().await;
    assert_eq!(ids(&broker), ["a", "b"]);
    assert_eq!(stats.published, 2);
    assert!(store.unsent().is_empty());
}

#[tokio::test(start_paused = true)]
async fn two_relays_never_share_a_leased_row() {
    let store = Arc::new(TestStore::default());
    let broker = Arc::new(TestBroker::default());
    broker.topics.lock().unwrap().push("t".into());
    for i in 0..50 {
        store.add(i, "t", &format!("m{i}"));
    }
    let a = Relay::builder(store.clone(), broker.clone())
        .batch_size(7)
        .build()
        .unwrap();
    let b = Relay::builder(store.clone(), broker.clone())
        .batch_size(7)
        .build()
        .unwrap();
    // Claim with both before either marks: their batches are disjoint.
    let ca = store
        .claim_batch(a.owner(), 7, Duration::from_secs(30))
        .await
        .unwrap();
    let cb = store
        .claim_batch(b.owner(), 7, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(ca.iter().all(|r| cb.iter().all(|s| s.seq != r.seq)));
    let (ha, hb) = (a.start(), b.start());
    tokio::time::sleep(Duration::from_secs(60)).await;
    let (sa, sb) = (ha.shutdown().await, hb.shutdown().await);
    let mut published = ids(&broker);
    assert_eq!(sa.published + sb.published, published.len() as u64);
    published.sort();
    published.dedup();
    // The 14 rows claimed by hand were never marked: they came back after their lease
    // and were published once, like every other row.
    assert_eq!(published.len(), 50);
    assert_eq!(ids(&broker).len(), 50);
}

#[test]
fn records_build_from_columns() {
    let cols = |h: &str| {
        (
            7,
            "id-7".to_owned(),
            "t".to_owned(),
            Some("r".to_owned()),
            Some("k".to_owned()),
            b"p".to_vec(),
            h.to_owned(),
        )
    };
    let r = OutboxRecord::from_columns(cols(r#"[["a","1"]]"#)).unwrap();
    assert_eq!(r.seq, 7);
    assert_eq!(r.destination, Destination::new("t").with_route("r"));
    assert_eq!(r.message.id().as_str(), "id-7");
    assert_eq!(r.message.key(), Some("k"));
    assert_eq!(r.message.headers().get("a"), Some("1"));
    let err = OutboxRecord::from_columns(cols("nope")).unwrap_err();
    assert!(err.to_string().contains("outbox row 7"), "{err}");
}

#[test]
fn headers_round_trip_in_order() {
    let h: Headers = [("b", "2"), ("a", "1 \"quoted\"")].into_iter().collect();
    let back = decode_headers(&encode_headers(&h)).unwrap();
    assert_eq!(back, h);
    assert!(decode_headers("{").is_err());
}

#[test]
fn bad_settings_name_the_field() {
    let store: Arc<dyn OutboxStore> = Arc::new(TestStore::default());
    let broker: Arc<dyn Broker> = Arc::new(TestBroker::default());
    let field = |b: RelayBuilder| b.build().err().map(|e| e.field);
    let b = || Relay::builder(store.clone(), broker.clone());
    assert_eq!(field(b().batch_size(0)), Some("batch_size"));
    assert_eq!(field(b().lease(Duration::ZERO)), Some("lease"));
    assert_eq!(field(b().name(" ")), Some("name"));
    assert_eq!(
        field(b().poll_interval(Duration::ZERO)),
        Some("poll_interval")
    );
    assert_eq!(
        field(b().backoff(Duration::from_secs(2), Duration::from_secs(1))),
        Some("backoff")
    );
    assert_eq!(field(b()), None);
}

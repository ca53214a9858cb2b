//! The durable inbox and outbox scenarios, written once and run against every store
//! (PostgreSQL and SQLite: `tests/stores_postgres.rs`, `tests/stores_sqlite.rs`).
//!
//! Each test gets an isolated store ([`Harness::new`]: a fresh schema on the shared
//! PostgreSQL database, a fresh SQLite file), so tests run in parallel and relays only
//! see their own rows; inbox scenarios also use unique consumer names and ids.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, ensure};
use async_trait::async_trait;
use reliq_core::{
    BoxError, Broker, Claim, Consumer, Delivery, Destination, Inbox, Message, MessageId,
    OutboxError, OutboxRecord, OutboxStore, Relay, RetryPolicy, Subscription, Transient,
    seam::Receiver,
};
use reliq_memory::MemoryBroker;
use reliq_postgres::sqlx::{self, PgPool, Postgres, SqlitePool, Transaction};
use reliq_postgres::{PgInbox, PgOutbox};
use reliq_sqlite::{SqliteInbox, SqliteOutbox};
use tokio::time::Instant;

use crate::settings;

/// What the scenarios need from a store: its transactional API behind one interface,
/// plus a few test hooks.
#[async_trait]
pub trait Harness: Send + Sync + Sized + 'static {
    /// The store's transaction type.
    type Tx: Send;
    /// An isolated, migrated store with an `effects` table for business changes.
    async fn new() -> anyhow::Result<Self>;
    /// Drop what [`Harness::new`] created.
    async fn cleanup(&self) -> anyhow::Result<()>;
    /// Begin a transaction the way a handler would.
    async fn begin(&self) -> anyhow::Result<Self::Tx>;
    /// Commit it.
    async fn commit(&self, tx: Self::Tx) -> anyhow::Result<()>;
    /// Roll it back.
    async fn rollback(&self, tx: Self::Tx) -> anyhow::Result<()>;
    /// The store's transactional claim.
    async fn claim(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: &MessageId,
    ) -> anyhow::Result<Claim>;
    /// A business change: one `effects` row.
    async fn apply_effect(&self, tx: &mut Self::Tx, id: &MessageId) -> anyhow::Result<()>;
    /// How many `effects` rows `id` has.
    async fn effects(&self, id: &MessageId) -> anyhow::Result<u64>;
    /// The store's transactional enqueue.
    async fn enqueue(
        &self,
        tx: &mut Self::Tx,
        destination: &Destination,
        message: &Message,
    ) -> anyhow::Result<bool>;
    /// Is `id` claimed for `consumer`?
    async fn contains(&self, consumer: &str, id: &MessageId) -> anyhow::Result<bool>;
    /// Make a claim look `by` older.
    async fn age_claim(&self, consumer: &str, id: &MessageId, by: Duration) -> anyhow::Result<()>;
    /// The store's purge.
    async fn purge(&self, older_than: Duration) -> anyhow::Result<u64>;
    /// The runtime-driven inbox, with a pending-claim lease.
    fn runtime_inbox(&self, pending_lease: Duration) -> Arc<dyn Inbox>;
    /// The outbox as a relay store.
    fn outbox(&self) -> Arc<dyn OutboxStore>;
    /// Unsent outbox rows.
    async fn unsent(&self) -> anyhow::Result<u64>;
    /// The last error recorded on the outbox row of `id`.
    async fn last_error(&self, id: &MessageId) -> anyhow::Result<Option<String>>;
    /// A relay's poll interval for the wake-up test, and the latency to assert.
    fn wake_up(&self) -> (Duration, Duration);
    /// Run an application's own migrations (sqlx's default table), then reliq's again.
    async fn migrate_beside_app(&self) -> anyhow::Result<()>;
    /// The versions recorded in a migrations table.
    async fn migration_versions(&self, table: &str) -> anyhow::Result<Vec<i64>>;
}

/// An application's own migrations, recorded in sqlx's default `_sqlx_migrations`.
fn app_migrator() -> sqlx::migrate::Migrator {
    use sqlx::SqlSafeStr;
    sqlx::migrate::Migrator::with_migrations(vec![sqlx::migrate::Migration::new(
        1,
        "app users".into(),
        sqlx::migrate::MigrationType::Simple,
        "CREATE TABLE app_users (id INTEGER)".into_sql_str(),
        false,
    )])
}

fn versions_query(table: &str) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(format!("SELECT version FROM {table} ORDER BY version"))
}

/// `impl Harness` for a store type: the methods that only delegate to the store's API
/// (fields `pool`, `inbox`, `outbox`; `$migrate`, the crate's migrate function) are the
/// same for every store; the store-specific ones follow in braces.
macro_rules! impl_harness {
    ($store:ty, $tx:ty, $migrate:path, { $($specific:tt)* }) => {
        #[async_trait]
        impl Harness for $store {
        type Tx = $tx;

        $($specific)*

        async fn commit(&self, tx: Self::Tx) -> anyhow::Result<()> {
            Ok(tx.commit().await?)
        }

        async fn rollback(&self, tx: Self::Tx) -> anyhow::Result<()> {
            Ok(tx.rollback().await?)
        }

        async fn claim(
            &self,
            tx: &mut Self::Tx,
            consumer: &str,
            id: &MessageId,
        ) -> anyhow::Result<Claim> {
            Ok(self.inbox.claim(tx, consumer, id).await?)
        }

        async fn enqueue(
            &self,
            tx: &mut Self::Tx,
            destination: &Destination,
            message: &Message,
        ) -> anyhow::Result<bool> {
            Ok(self.outbox.enqueue(tx, destination, message).await?)
        }

        async fn contains(&self, consumer: &str, id: &MessageId) -> anyhow::Result<bool> {
            Ok(self.inbox.contains(consumer, id).await?)
        }

        async fn purge(&self, older_than: Duration) -> anyhow::Result<u64> {
            Ok(self.inbox.purge(older_than).await?)
        }

        fn runtime_inbox(&self, pending_lease: Duration) -> Arc<dyn Inbox> {
            Arc::new(self.inbox.clone().pending_lease(pending_lease))
        }

        fn outbox(&self) -> Arc<dyn OutboxStore> {
            Arc::new(self.outbox.clone())
        }

        async fn unsent(&self) -> anyhow::Result<u64> {
            Ok(self.outbox.unsent().await?)
        }

        async fn migrate_beside_app(&self) -> anyhow::Result<()> {
            app_migrator().run(&self.pool).await?;
            Ok($migrate(&self.pool).await?)
        }

        async fn migration_versions(&self, table: &str) -> anyhow::Result<Vec<i64>> {
            let rows: Vec<(i64,)> = sqlx::query_as(versions_query(table))
                .fetch_all(&self.pool)
                .await?;
            Ok(rows.into_iter().map(|(v,)| v).collect())
        }

        async fn effects(&self, id: &MessageId) -> anyhow::Result<u64> {
            let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM effects WHERE id = $1")
                .bind(id.as_str())
                .fetch_one(&self.pool)
                .await?;
            Ok(u64::try_from(n)?)
        }

        async fn last_error(&self, id: &MessageId) -> anyhow::Result<Option<String>> {
            let (e,): (Option<String>,) =
                sqlx::query_as("SELECT last_error FROM reliq_outbox WHERE message_id = $1")
                    .bind(id.as_str())
                    .fetch_one(&self.pool)
                    .await?;
            Ok(e)
        }
        }
    };
}

/// A store on the shared PostgreSQL database, in a schema of its own.
pub struct Pg {
    /// The pool (its connections use the test's schema).
    pub pool: PgPool,
    schema: String,
    url: String,
    inbox: PgInbox,
    outbox: PgOutbox,
}

/// A unique lowercase name with `prefix`.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        MessageId::generate().as_str().replace('-', "_")
    )
}

impl Pg {
    /// A pool whose connections use `schema`.
    pub async fn pool_in(url: &str, schema: &str) -> anyhow::Result<PgPool> {
        let options =
            sqlx::postgres::PgConnectOptions::from_str(url)?.options([("search_path", schema)]);
        Ok(sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect_with(options)
            .await?)
    }

    /// A fresh schema on the database of `RELIQ_POSTGRES_URL`, migrated.
    pub async fn isolated() -> anyhow::Result<Self> {
        Self::isolated_on(&settings::get("RELIQ_POSTGRES_URL")).await
    }

    /// [`Harness::new`] on the database of `url`: a fresh schema, migrated, with the
    /// `effects` table.
    pub async fn on(url: &str) -> anyhow::Result<Self> {
        let pg = Self::isolated_on(url).await?;
        sqlx::query("CREATE TABLE effects (id TEXT NOT NULL)")
            .execute(&pg.pool)
            .await?;
        Ok(pg)
    }

    /// A fresh schema on the database of `url`, migrated.
    pub async fn isolated_on(url: &str) -> anyhow::Result<Self> {
        let url = url.to_owned();
        let schema = unique("reliq_test");
        let admin = PgPool::connect(&url)
            .await
            .with_context(|| format!("connecting to {url} (is `scripts/brokers up` done?)"))?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await?;
        admin.close().await;
        let pool = Self::pool_in(&url, &schema).await?;
        reliq_postgres::migrate(&pool).await?;
        Ok(Self {
            inbox: PgInbox::new(pool.clone()),
            outbox: PgOutbox::new(pool.clone()),
            pool,
            schema,
            url,
        })
    }
}

impl_harness!(
    Pg,
    Transaction<'static, Postgres>,
    reliq_postgres::migrate,
    {
        async fn new() -> anyhow::Result<Self> {
            Self::on(&settings::get("RELIQ_POSTGRES_URL")).await
        }

        async fn cleanup(&self) -> anyhow::Result<()> {
            self.pool.close().await;
            let admin = PgPool::connect(&self.url).await?;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA {} CASCADE",
                self.schema
            )))
            .execute(&admin)
            .await?;
            admin.close().await;
            Ok(())
        }

        async fn begin(&self) -> anyhow::Result<Self::Tx> {
            Ok(self.pool.begin().await?)
        }

        async fn apply_effect(&self, tx: &mut Self::Tx, id: &MessageId) -> anyhow::Result<()> {
            sqlx::query("INSERT INTO effects (id) VALUES ($1)")
                .bind(id.as_str())
                .execute(&mut **tx)
                .await?;
            Ok(())
        }

        async fn age_claim(
            &self,
            consumer: &str,
            id: &MessageId,
            by: Duration,
        ) -> anyhow::Result<()> {
            sqlx::query(
                "UPDATE reliq_inbox SET claimed_at = claimed_at - make_interval(secs => $3) \
             WHERE consumer = $1 AND message_id = $2",
            )
            .bind(consumer)
            .bind(id.as_str())
            .bind(by.as_secs_f64())
            .execute(&self.pool)
            .await?;
            Ok(())
        }

        /// NOTIFY wakes the relay: a 30 s poll, and the message must arrive within 5 s
        /// (a claim round on a loaded CI machine, over TLS, has taken over 1 s; a relay
        /// that missed the NOTIFY would wait out the 30 s poll).
        fn wake_up(&self) -> (Duration, Duration) {
            (Duration::from_secs(30), Duration::from_secs(5))
        }
    }
);

/// A store in a fresh SQLite file.
pub struct Lite {
    /// The pool.
    pub pool: SqlitePool,
    _dir: tempfile::TempDir,
    inbox: SqliteInbox,
    outbox: SqliteOutbox,
}

impl Lite {
    /// A migrated store in a new file of a new temporary directory.
    pub async fn isolated() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let url = format!("sqlite://{}", dir.path().join("reliq.db").display());
        let pool = reliq_sqlite::connect(&url).await?;
        reliq_sqlite::migrate(&pool).await?;
        Ok(Self {
            inbox: SqliteInbox::new(pool.clone()),
            outbox: SqliteOutbox::new(pool.clone()),
            pool,
            _dir: dir,
        })
    }
}

impl_harness!(
    Lite,
    Transaction<'static, sqlx::Sqlite>,
    reliq_sqlite::migrate,
    {
        async fn new() -> anyhow::Result<Self> {
            let lite = Self::isolated().await?;
            sqlx::query("CREATE TABLE effects (id TEXT NOT NULL)")
                .execute(&lite.pool)
                .await?;
            Ok(lite)
        }

        async fn cleanup(&self) -> anyhow::Result<()> {
            self.pool.close().await;
            Ok(())
        }

        async fn begin(&self) -> anyhow::Result<Self::Tx> {
            Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
        }

        async fn apply_effect(&self, tx: &mut Self::Tx, id: &MessageId) -> anyhow::Result<()> {
            sqlx::query("INSERT INTO effects (id) VALUES (?1)")
                .bind(id.as_str())
                .execute(&mut **tx)
                .await?;
            Ok(())
        }

        async fn age_claim(
            &self,
            consumer: &str,
            id: &MessageId,
            by: Duration,
        ) -> anyhow::Result<()> {
            sqlx::query(
                "UPDATE reliq_inbox SET claimed_at = claimed_at - ?3 \
             WHERE consumer = ?1 AND message_id = ?2",
            )
            .bind(consumer)
            .bind(id.as_str())
            .bind(i64::try_from(by.as_millis())?)
            .execute(&self.pool)
            .await?;
            Ok(())
        }

        /// SQLite polls: the default 100 ms poll, and the message must arrive within 1 s.
        fn wake_up(&self) -> (Duration, Duration) {
            (Duration::from_millis(100), Duration::from_secs(1))
        }
    }
);

/// Stamp out one `#[tokio::test]` per scenario for a harness type: `store_tests!(Pg)`
/// runs every scenario of this module.
#[macro_export]
macro_rules! store_tests {
    ($harness:ty) => {
        $crate::store_tests!($harness;
            migrations_use_their_own_table,
            claim_first_then_duplicate,
            rollback_forgets_the_claim,
            concurrent_claims_have_one_first,
            purge_deletes_only_old_claims,
            runtime_inbox_claim_complete_abandon,
            consumer_skips_duplicates_with_the_marker,
            rolled_back_enqueue_is_not_published,
            relay_publishes_in_enqueue_order,
            crash_between_publish_and_mark_republishes,
            two_relays_publish_each_row_once,
            idle_relay_wakes_up_fast,
            publish_failure_keeps_the_row,
            outbox_backlog_counts_unsent_rows_and_the_oldest_age,
        );
    };
    ($harness:ty; $($scenario:ident),* $(,)?) => {
        $crate::store_tests!($harness = <$harness as $crate::stores::Harness>::new(); $($scenario),*);
    };
    // The store made by `$new` (another database URL).
    ($harness:ty = $new:expr; $($scenario:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $scenario() -> anyhow::Result<()> {
            use $crate::stores::Harness as _;
            let h: std::sync::Arc<$harness> = std::sync::Arc::new($new.await?);
            $crate::stores::$scenario(h.clone()).await?;
            h.cleanup().await
        }
    )*};
}

/// reliq's migrations live in their own table beside the application's, and running
/// them again changes nothing.
pub async fn migrations_use_their_own_table<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    h.migrate_beside_app().await?;
    ensure!(h.migration_versions("_sqlx_migrations").await? == [1]);
    ensure!(h.migration_versions("_reliq_migrations").await? == [20250601000001]);
    Ok(())
}

async fn claim_once<H: Harness>(h: &H, consumer: &str, id: &MessageId) -> anyhow::Result<Claim> {
    let mut tx = h.begin().await?;
    let claim = h.claim(&mut tx, consumer, id).await?;
    h.commit(tx).await?;
    Ok(claim)
}

/// First claim wins, a second claim in the same or a later transaction is a duplicate,
/// another consumer has its own claim.
pub async fn claim_first_then_duplicate<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let (consumer, id) = (unique("c"), MessageId::generate());
    let mut tx = h.begin().await?;
    ensure!(h.claim(&mut tx, &consumer, &id).await? == Claim::First);
    ensure!(h.claim(&mut tx, &consumer, &id).await? == Claim::Duplicate);
    h.commit(tx).await?;
    ensure!(claim_once(&*h, &consumer, &id).await? == Claim::Duplicate);
    ensure!(claim_once(&*h, &unique("other"), &id).await? == Claim::First);
    ensure!(h.contains(&consumer, &id).await?);
    ensure!(!h.contains(&consumer, &MessageId::generate()).await?);
    Ok(())
}

/// A rolled-back transaction takes its claim (and its effect) with it.
pub async fn rollback_forgets_the_claim<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let (consumer, id) = (unique("c"), MessageId::generate());
    let mut tx = h.begin().await?;
    ensure!(h.claim(&mut tx, &consumer, &id).await? == Claim::First);
    h.apply_effect(&mut tx, &id).await?;
    h.rollback(tx).await?;
    ensure!(!h.contains(&consumer, &id).await?);
    ensure!(h.effects(&id).await? == 0);
    ensure!(claim_once(&*h, &consumer, &id).await? == Claim::First);
    Ok(())
}

/// Eight transactions claim one id at once: exactly one is first.
pub async fn concurrent_claims_have_one_first<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let (consumer, id) = (Arc::new(unique("c")), MessageId::generate());
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (h, consumer, id) = (h.clone(), consumer.clone(), id.clone());
            tokio::spawn(async move {
                let mut tx = h.begin().await?;
                let claim = h.claim(&mut tx, &consumer, &id).await?;
                if claim == Claim::First {
                    h.apply_effect(&mut tx, &id).await?;
                    // Hold the claim uncommitted a while: the others must wait, not win.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                h.commit(tx).await?;
                anyhow::Ok(claim)
            })
        })
        .collect();
    let mut firsts = 0;
    for t in tasks {
        if t.await?? == Claim::First {
            firsts += 1;
        }
    }
    ensure!(firsts == 1, "{firsts} claims were first");
    ensure!(h.effects(&id).await? == 1);
    Ok(())
}

/// Purge deletes the claims older than the horizon and keeps the rest.
pub async fn purge_deletes_only_old_claims<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let consumer = unique("c");
    let (old, young) = (MessageId::generate(), MessageId::generate());
    for id in [&old, &young] {
        ensure!(claim_once(&*h, &consumer, id).await? == Claim::First);
    }
    let day = Duration::from_secs(86_400);
    h.age_claim(&consumer, &old, 2 * day).await?;
    ensure!(h.purge(day).await? == 1);
    ensure!(!h.contains(&consumer, &old).await?);
    ensure!(h.contains(&consumer, &young).await?);
    // Past the horizon the id is forgotten: a replay would be applied again.
    ensure!(claim_once(&*h, &consumer, &old).await? == Claim::First);
    ensure!(h.purge(day).await? == 0);
    Ok(())
}

/// The runtime-driven protocol: claim, complete, abandon, and the takeover of a pending
/// claim whose handler died.
pub async fn runtime_inbox_claim_complete_abandon<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    // The pending lease must outlast two claims on a loaded CI machine (300 ms did not).
    let lease = Duration::from_secs(3);
    let inbox = h.runtime_inbox(lease);
    let (c, id) = (unique("c"), MessageId::generate());
    ensure!(inbox.claim(&c, &id).await? == Claim::First);
    ensure!(
        inbox.claim(&c, &id).await? == Claim::Duplicate,
        "pending blocks"
    );
    ensure!(!h.contains(&c, &id).await?, "pending is not done");
    inbox.abandon(&c, &id).await?;
    ensure!(
        inbox.claim(&c, &id).await? == Claim::First,
        "abandon forgets"
    );
    inbox.complete(&c, &id).await?;
    ensure!(h.contains(&c, &id).await?);
    inbox.abandon(&c, &id).await?;
    ensure!(
        inbox.claim(&c, &id).await? == Claim::Duplicate,
        "done stays done"
    );
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    ensure!(
        inbox.claim(&c, &id).await? == Claim::Duplicate,
        "done never expires"
    );

    // A pending claim whose handler died is taken over after its lease.
    let dead = MessageId::generate();
    ensure!(inbox.claim(&c, &dead).await? == Claim::First);
    ensure!(inbox.claim(&c, &dead).await? == Claim::Duplicate);
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    ensure!(
        inbox.claim(&c, &dead).await? == Claim::First,
        "stale pending is taken over"
    );
    Ok(())
}

/// The consumer runtime with a transactional claim: copies of a processed message are
/// acknowledged, skipped and counted (the handler returns `Duplicate`); a failed attempt
/// rolls its claim back, so the retry applies the effect.
pub async fn consumer_skips_duplicates_with_the_marker<H: Harness>(
    h: Arc<H>,
) -> anyhow::Result<()> {
    let broker = MemoryBroker::new();
    let consumer = unique("inventory");
    let (dup, flaky) = (MessageId::generate(), MessageId::generate());
    let handle = start_effect_consumer(h.clone(), &broker, &consumer, Some(flaky.clone())).await?;
    for id in [&dup, &dup, &flaky, &dup] {
        broker
            .publish(
                &Destination::new(consumer.as_str()),
                Message::with_id_and_payload(id.clone(), "x"),
            )
            .await?;
    }
    wait_until("all settled", Duration::from_secs(20), || {
        let s = handle.stats();
        s.processed == 2 && s.duplicates == 2
    })
    .await?;
    let stats = handle.shutdown().await.stats;
    ensure!(stats.retried == 1 && stats.dead_lettered == 0, "{stats:?}");
    ensure!(h.effects(&dup).await? == 1);
    ensure!(h.effects(&flaky).await? == 1);
    ensure!(h.contains(&consumer, &dup).await? && h.contains(&consumer, &flaky).await?);
    Ok(())
}

/// A consumer reading topic `consumer` that claims, applies one effect and commits; the
/// first attempt of `flaky` fails transiently after its claim and effect.
async fn start_effect_consumer<H: Harness>(
    h: Arc<H>,
    broker: &MemoryBroker,
    consumer: &str,
    flaky: Option<MessageId>,
) -> anyhow::Result<reliq_core::ConsumerHandle> {
    let name: Arc<str> = Arc::from(consumer);
    let handle = Consumer::builder(Arc::new(broker.clone()), consumer)
        .subscribe(consumer)
        .retry(RetryPolicy::tiers([Duration::from_millis(100)]).max_attempts(3))
        .start(move |d: Delivery| {
            let (h, name, flaky) = (h.clone(), name.clone(), flaky.clone());
            async move {
                let mut tx = h.begin().await.map_err(BoxError::from)?;
                h.claim(&mut tx, &name, d.id())
                    .await
                    .map_err(BoxError::from)?
                    .first_or_skip()?;
                h.apply_effect(&mut tx, d.id())
                    .await
                    .map_err(BoxError::from)?;
                if flaky.as_ref() == Some(d.id()) && d.attempt() == 1 {
                    // Dropping the transaction rolls back the claim and the effect.
                    return Err(Transient::msg("database hiccup").into());
                }
                h.commit(tx).await.map_err(BoxError::from)?;
                Ok::<(), BoxError>(())
            }
        })
        .await?;
    Ok(handle)
}

/// Poll `cond` every 20 ms until it holds, or fail after `limit`.
pub async fn wait_until(
    what: &str,
    limit: Duration,
    mut cond: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while !cond() {
        ensure!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// A broker with a subscribed group on a fresh topic, to count what a relay published.
struct Sink {
    broker: Arc<MemoryBroker>,
    topic: Destination,
    rx: Box<dyn Receiver>,
}

impl Sink {
    async fn new() -> anyhow::Result<Self> {
        let broker = Arc::new(MemoryBroker::new());
        let topic = unique("events");
        let rx = broker.subscribe(&Subscription::new("sink", &topic)).await?;
        Ok(Self {
            broker,
            topic: Destination::new(topic),
            rx,
        })
    }

    fn broker(&self) -> Arc<dyn Broker> {
        self.broker.clone()
    }

    /// The broker, confirming each publish after `delay` (a real broker's round trip), so
    /// claimed batches stay unmarked for a while.
    fn slow_broker(&self, delay: Duration) -> Arc<dyn Broker> {
        Arc::new(Slow {
            inner: self.broker.clone(),
            delay,
        })
    }
    /// The ids delivered until nothing arrives for `quiet`, acknowledged.
    async fn drain(&self, quiet: Duration) -> anyhow::Result<Vec<String>> {
        let mut ids = Vec::new();
        while let Ok(d) = tokio::time::timeout(quiet, self.rx.receive()).await {
            let d = d?;
            ids.push(d.id().as_str().to_owned());
            self.rx.ack(&d).await?;
        }
        Ok(ids)
    }

    /// Exactly `n` ids, waiting up to `limit` for them.
    async fn take(&self, n: usize, limit: Duration) -> anyhow::Result<Vec<String>> {
        let mut ids = Vec::new();
        while ids.len() < n {
            let d = tokio::time::timeout(limit, self.rx.receive())
                .await
                .with_context(|| format!("only {} of {n} messages arrived", ids.len()))??;
            ids.push(d.id().as_str().to_owned());
            self.rx.ack(&d).await?;
        }
        Ok(ids)
    }
}

/// A broker whose confirms take `delay`.
struct Slow {
    inner: Arc<MemoryBroker>,
    delay: Duration,
}

#[async_trait]
impl Broker for Slow {
    fn kind(&self) -> &'static str {
        "slow-memory"
    }
    fn capabilities(&self) -> reliq_core::Capabilities {
        self.inner.capabilities()
    }
    async fn publish(&self, d: &Destination, m: Message) -> Result<(), reliq_core::BrokerError> {
        tokio::time::sleep(self.delay).await;
        self.inner.publish(d, m).await
    }
    async fn subscribe(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn Receiver>, reliq_core::BrokerError> {
        self.inner.subscribe(s).await
    }
    async fn dead_letters(
        &self,
        s: &Subscription,
    ) -> Result<Box<dyn reliq_core::DeadLetters>, reliq_core::BrokerError> {
        self.inner.dead_letters(s).await
    }
    async fn ping(&self) -> Result<(), reliq_core::BrokerError> {
        self.inner.ping().await
    }
    async fn backlog(
        &self,
        s: &Subscription,
    ) -> Result<reliq_core::Backlog, reliq_core::BrokerError> {
        self.inner.backlog(s).await
    }

    async fn plan(&self, s: &Subscription) -> Result<reliq_core::Plan, reliq_core::BrokerError> {
        self.inner.plan(s).await
    }

    async fn inspect(
        &self,
        s: &Subscription,
        plan: &reliq_core::Plan,
    ) -> Result<reliq_core::LiveTopology, reliq_core::BrokerError> {
        self.inner.inspect(s, plan).await
    }
}

/// Enqueue `ids` (each in its own committed transaction) for `topic`.
async fn enqueue_each<H: Harness>(
    h: &H,
    topic: &Destination,
    ids: &[MessageId],
) -> anyhow::Result<()> {
    for id in ids {
        let mut tx = h.begin().await?;
        ensure!(
            h.enqueue(
                &mut tx,
                topic,
                &Message::with_id_and_payload(id.clone(), "e")
            )
            .await?
        );
        h.commit(tx).await?;
    }
    Ok(())
}

fn ids(n: usize, prefix: &str) -> Vec<MessageId> {
    let run = unique(prefix);
    (0..n)
        .map(|i| MessageId::from(format!("{run}-{i:04}")))
        .collect()
}

fn strings(ids: &[MessageId]) -> Vec<String> {
    ids.iter().map(|i| i.as_str().to_owned()).collect()
}

/// A rolled-back enqueue is never published; enqueueing an id again is a no-op; what was
/// committed is published with its id, route, key, headers and payload.
pub async fn rolled_back_enqueue_is_not_published<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let sink = Sink::new().await?;
    let (gone, kept) = (MessageId::generate(), MessageId::generate());
    let mut tx = h.begin().await?;
    ensure!(
        h.enqueue(
            &mut tx,
            &sink.topic,
            &Message::with_id_and_payload(gone.clone(), "no")
        )
        .await?
    );
    h.rollback(tx).await?;
    let message = Message::with_id_and_payload(kept.clone(), "yes")
        .with_key("k-1")
        .with_header("tenant", "acme");
    let mut tx = h.begin().await?;
    ensure!(h.enqueue(&mut tx, &sink.topic, &message).await?);
    ensure!(
        !h.enqueue(&mut tx, &sink.topic, &message).await?,
        "same id twice"
    );
    h.commit(tx).await?;
    ensure!(h.unsent().await? == 1);

    let relay = Relay::builder(h.outbox(), sink.broker()).build()?;
    ensure!(relay.run_once().await? == 1);
    ensure!(relay.run_once().await? == 0);
    let d = tokio::time::timeout(Duration::from_secs(5), sink.rx.receive()).await??;
    ensure!(
        d.message() == &message,
        "published as enqueued: {:?}",
        d.message()
    );
    sink.rx.ack(&d).await?;
    ensure!(sink.drain(Duration::from_millis(200)).await?.is_empty());
    ensure!(h.unsent().await? == 0);
    ensure!(relay.stats().published == 1);
    Ok(())
}

/// One relay publishes in enqueue order, across batches.
pub async fn relay_publishes_in_enqueue_order<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let sink = Sink::new().await?;
    let expected = ids(40, "order");
    enqueue_each(&*h, &sink.topic, &expected).await?;
    let relay = Relay::builder(h.outbox(), sink.broker())
        .batch_size(7)
        .build()?
        .start();
    let got = sink.take(expected.len(), Duration::from_secs(10)).await?;
    let stats = relay.shutdown().await;
    ensure!(got == strings(&expected), "out of order: {got:?}");
    ensure!(stats.published == 40 && stats.batches == 6, "{stats:?}");
    ensure!(h.unsent().await? == 0);
    ensure!(sink.drain(Duration::from_millis(200)).await?.is_empty());
    Ok(())
}

/// A store that "crashes" the relay after the broker confirmed a batch and before the
/// rows are marked: `mark_sent` never returns.
struct CrashBeforeMark {
    inner: Arc<dyn OutboxStore>,
    reached: AtomicBool,
}

#[async_trait]
impl OutboxStore for CrashBeforeMark {
    async fn claim_batch(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<OutboxRecord>, OutboxError> {
        self.inner.claim_batch(owner, limit, lease).await
    }
    async fn mark_sent(&self, _owner: &str, _seqs: &[i64]) -> Result<(), OutboxError> {
        self.reached.store(true, Ordering::SeqCst);
        std::future::pending().await
    }
    async fn release(&self, owner: &str, seqs: &[i64], error: &str) -> Result<(), OutboxError> {
        self.inner.release(owner, seqs, error).await
    }
}

/// A relay dies between the broker's confirm and the mark: after the lease (not before)
/// another relay publishes the rows again, with the same ids, and a consumer with the
/// transactional inbox applies each effect once.
pub async fn crash_between_publish_and_mark_republishes<H: Harness>(
    h: Arc<H>,
) -> anyhow::Result<()> {
    let broker = MemoryBroker::new();
    let consumer = unique("billing");
    let consumer_handle = start_effect_consumer(h.clone(), &broker, &consumer, None).await?;
    let expected = ids(3, "crash");
    enqueue_each(&*h, &Destination::new(consumer.as_str()), &expected).await?;

    let lease = Duration::from_secs(2);
    let crashing = Arc::new(CrashBeforeMark {
        inner: h.outbox(),
        reached: AtomicBool::new(false),
    });
    let first = Relay::builder(crashing.clone(), Arc::new(broker.clone()))
        .lease(lease)
        .build()?
        .start();
    wait_until("the first relay's publish", Duration::from_secs(10), || {
        crashing.reached.load(Ordering::SeqCst)
    })
    .await?;
    let crashed_at = Instant::now();
    first.crash().await;
    ensure!(h.unsent().await? == 3, "nothing was marked");

    let second = Relay::builder(h.outbox(), Arc::new(broker.clone()))
        .lease(lease)
        .poll_interval(Duration::from_millis(50))
        .build()?
        .start();
    // While the dead relay's lease holds, nobody publishes the rows again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        second.stats().published == 0,
        "republished while the lease held"
    );
    wait_until("the republish", Duration::from_secs(10), || {
        second.stats().published == 3
    })
    .await?;
    ensure!(crashed_at.elapsed() >= lease - Duration::from_millis(600));
    wait_until("both copies consumed", Duration::from_secs(10), || {
        let s = consumer_handle.stats();
        s.processed + s.duplicates == 6
    })
    .await?;
    let relay_stats = second.shutdown().await;
    let stats = consumer_handle.shutdown().await.stats;
    ensure!(relay_stats.published == 3, "{relay_stats:?}");
    ensure!(stats.received == 6, "each id delivered twice: {stats:?}");
    ensure!(stats.processed == 3 && stats.duplicates == 3, "{stats:?}");
    for id in &expected {
        ensure!(h.effects(id).await? == 1, "{id} applied once");
    }
    ensure!(h.unsent().await? == 0);
    Ok(())
}

/// Two relays on one outbox: every row is published, none twice.
pub async fn two_relays_publish_each_row_once<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let sink = Sink::new().await?;
    let expected = ids(200, "pair");
    let relays: Vec<_> = (0..2)
        .map(|i| {
            Relay::builder(h.outbox(), sink.slow_broker(Duration::from_millis(2)))
                .name(format!("relay-{i}"))
                .batch_size(5)
                .poll_interval(Duration::from_millis(20))
                .build()
                .map(Relay::start)
        })
        .collect::<Result<_, _>>()?;
    // Enqueue while both run, so they compete for the same rows.
    enqueue_each(&*h, &sink.topic, &expected).await?;
    let got = sink.take(expected.len(), Duration::from_secs(20)).await?;
    let mut stats = Vec::new();
    for r in relays {
        stats.push(r.shutdown().await);
    }
    let extra = sink.drain(Duration::from_millis(300)).await?;
    ensure!(extra.is_empty(), "published twice: {extra:?}");
    let mut counts: HashMap<&str, u32> = HashMap::new();
    for id in &got {
        *counts.entry(id.as_str()).or_default() += 1;
    }
    ensure!(counts.len() == 200 && counts.values().all(|n| *n == 1));
    ensure!(stats.iter().map(|s| s.published).sum::<u64>() == 200);
    ensure!(
        stats.iter().all(|s| s.published > 0),
        "both relays took part: {stats:?}"
    );
    ensure!(h.unsent().await? == 0);
    Ok(())
}

/// An idle relay publishes a committed row long before its poll interval on Postgres
/// (LISTEN/NOTIFY), within a short poll on SQLite.
pub async fn idle_relay_wakes_up_fast<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let sink = Sink::new().await?;
    let (poll, limit) = h.wake_up();
    let relay = Relay::builder(h.outbox(), sink.broker())
        .poll_interval(poll)
        .build()?
        .start();
    let mut latencies = Vec::new();
    for id in ids(3, "wake") {
        // Let the relay go idle (claim nothing, wait).
        tokio::time::sleep(Duration::from_millis(300)).await;
        enqueue_each(&*h, &sink.topic, std::slice::from_ref(&id)).await?;
        let committed = Instant::now();
        let got = sink.take(1, poll + Duration::from_secs(5)).await?;
        latencies.push(committed.elapsed());
        ensure!(got == [id.as_str()]);
    }
    relay.shutdown().await;
    let worst = latencies.iter().max().copied().unwrap_or_default();
    ensure!(
        worst < limit,
        "wake-up took {latencies:?} (poll interval {poll:?}, limit {limit:?})"
    );
    Ok(())
}

/// A publish that fails keeps the row (released, error recorded), the relay backs off
/// instead of spinning, and publishes it once the route exists.
pub async fn publish_failure_keeps_the_row<H: Harness>(h: Arc<H>) -> anyhow::Result<()> {
    let broker = Arc::new(MemoryBroker::new());
    let topic = unique("late");
    let id = MessageId::generate();
    enqueue_each(
        &*h,
        &Destination::new(topic.as_str()),
        std::slice::from_ref(&id),
    )
    .await?;
    let relay = Relay::builder(h.outbox(), broker.clone())
        .backoff(Duration::from_millis(100), Duration::from_millis(400))
        .poll_interval(Duration::from_millis(20))
        .build()?
        .start();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let failures = relay.stats().publish_failures;
    // 100, 200, 400, 400 ms (+ jitter below each): a few tries, not hundreds.
    ensure!((2..=12).contains(&failures), "{failures} publish failures");
    ensure!(h.unsent().await? == 1);
    let error = h.last_error(&id).await?.unwrap_or_default();
    ensure!(error.contains("unroutable"), "last error: {error:?}");
    // The route appears: the row goes out, once.
    let rx = broker.subscribe(&Subscription::new("late", &topic)).await?;
    let d = tokio::time::timeout(Duration::from_secs(5), rx.receive()).await??;
    ensure!(d.id() == &id);
    rx.ack(&d).await?;
    let stats = relay.shutdown().await;
    ensure!(stats.published == 1, "{stats:?}");
    ensure!(h.unsent().await? == 0);
    Ok(())
}

/// The store's backlog (the relay's gauges): nothing at first; three rows enqueued, then
/// their count and the oldest one's age (at least the time waited since, well under a
/// minute); once claimed and marked sent, nothing again.
pub async fn outbox_backlog_counts_unsent_rows_and_the_oldest_age<H: Harness>(
    h: Arc<H>,
) -> anyhow::Result<()> {
    let outbox = h.outbox();
    let empty = outbox
        .backlog()
        .await?
        .context("the store counts its backlog")?;
    ensure!(
        empty.rows == 0 && empty.oldest_age == Duration::ZERO,
        "{empty:?}"
    );
    let ids: Vec<MessageId> = (0..3).map(|_| MessageId::generate()).collect();
    enqueue_each(&*h, &Destination::new("backlog"), &ids).await?;
    let waited = Duration::from_millis(300);
    tokio::time::sleep(waited).await;
    let three = outbox.backlog().await?.context("backlog")?;
    ensure!(
        three.rows == 3
            && three.oldest_age >= waited - Duration::from_millis(50)
            && three.oldest_age < Duration::from_secs(60),
        "{three:?}"
    );
    let claimed = outbox
        .claim_batch("backlog-test", 10, Duration::from_secs(30))
        .await?;
    ensure!(claimed.len() == 3, "claimed {}", claimed.len());
    let seqs: Vec<i64> = claimed.iter().map(|r| r.seq).collect();
    outbox.mark_sent("backlog-test", &seqs).await?;
    let none = outbox.backlog().await?.context("backlog")?;
    ensure!(
        none.rows == 0 && none.oldest_age == Duration::ZERO,
        "{none:?}"
    );
    Ok(())
}

//! The durable inbox and outbox scenarios (`reliq_integration::stores`) on SQLite, one database file per test.

reliq_integration::store_tests!(reliq_integration::stores::Lite);

/// A real `SQLITE_BUSY` (another connection holds the write lock past the busy timeout)
/// is transient through `reliq_sqlite::with_error_rules`; a constraint violation stays
/// unknown.
#[tokio::test]
async fn sqlite_busy_is_transient() -> anyhow::Result<()> {
    use reliq_core::{BoxError, Classifier, ErrorClass};
    use sqlx::sqlite::SqliteConnectOptions;
    use sqlx::{ConnectOptions, Connection};
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("busy.db");
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .busy_timeout(std::time::Duration::from_millis(50));
    let mut holder = options.connect().await?;
    sqlx::query("CREATE TABLE t (id INTEGER PRIMARY KEY)")
        .execute(&mut holder)
        .await?;
    let mut other = options.connect().await?;
    let mut lock = holder.begin_with("BEGIN IMMEDIATE").await?;
    let err = sqlx::query("INSERT INTO t (id) VALUES (1)")
        .execute(&mut other)
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("wrote past another connection's write lock"))?;
    let classifier = reliq_sqlite::with_error_rules(Classifier::default());
    let handler_error: BoxError = anyhow::Error::new(err).context("reserving stock").into();
    anyhow::ensure!(
        classifier.classify(handler_error.as_ref()) == ErrorClass::Transient,
        "{handler_error:?}"
    );
    sqlx::query("INSERT INTO t (id) VALUES (1)")
        .execute(&mut *lock)
        .await?;
    lock.commit().await?;
    let err = sqlx::query("INSERT INTO t (id) VALUES (1)")
        .execute(&mut other)
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("a duplicate primary key was accepted"))?;
    anyhow::ensure!(
        reliq_sqlite::error_class(&err) == ErrorClass::Unknown,
        "{err:?}"
    );
    Ok(())
}

//! The durable inbox and outbox scenarios (`reliq_integration::stores`) on the real PostgreSQL of `scripts/brokers` (`RELIQ_POSTGRES_URL`), one schema per test.

reliq_integration::store_tests!(reliq_integration::stores::Pg);

/// Real PostgreSQL errors through `reliq_postgres::with_error_rules`: the SQLSTATEs a
/// retry resolves are transient, a constraint violation stays unknown.
#[tokio::test]
async fn postgres_errors_are_classified_by_sqlstate() -> anyhow::Result<()> {
    use reliq_core::{BoxError, Classifier, ErrorClass};
    let store = reliq_integration::stores::Pg::isolated().await?;
    let classifier = reliq_postgres::with_error_rules(Classifier::default());
    let raise =
        |code: &str| format!("DO $$ BEGIN RAISE EXCEPTION 'test' USING ERRCODE = '{code}'; END $$");
    for (code, class) in [
        ("40001", ErrorClass::Transient), // serialization_failure
        ("40P01", ErrorClass::Transient), // deadlock_detected
        ("55P03", ErrorClass::Transient), // lock_not_available
        ("23505", ErrorClass::Unknown),   // unique_violation
    ] {
        let err = sqlx::query(sqlx::AssertSqlSafe(raise(code)))
            .execute(&store.pool)
            .await
            .err()
            .ok_or_else(|| anyhow::anyhow!("RAISE {code} did not fail"))?;
        // As a handler returns it: the sqlx error wrapped in a context error.
        let handler_error: BoxError = anyhow::Error::new(err).context("reserving stock").into();
        anyhow::ensure!(
            classifier.classify(handler_error.as_ref()) == class,
            "{code}: {handler_error:?} is not {class:?}"
        );
    }
    // A statement timeout is a real `57014`.
    let mut conn = store.pool.acquire().await?;
    sqlx::query("SET statement_timeout = '50ms'")
        .execute(&mut *conn)
        .await?;
    let err = sqlx::query("SELECT pg_sleep(2)")
        .execute(&mut *conn)
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("pg_sleep outlived the statement timeout"))?;
    anyhow::ensure!(
        reliq_postgres::error_class(&err) == ErrorClass::Transient,
        "{err:?}"
    );
    Ok(())
}

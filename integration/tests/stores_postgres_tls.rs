//! The PostgreSQL inbox and outbox over TLS with the server verified
//! (`sslmode=verify-full`, the test CA) on the secured set's TLS-only cluster
//! (`scripts/brokers secure up`); what `verify-full` refuses fails at connect, naming it.

use reliq_integration::secure::postgres_url;
use reliq_integration::stores::Pg;

fn verified() -> String {
    postgres_url("verify-full", "ca")
}

reliq_integration::store_tests!(Pg = Pg::on(&verified());
    claim_first_then_duplicate,
    concurrent_claims_have_one_first,
    runtime_inbox_claim_complete_abandon,
    relay_publishes_in_enqueue_order,
    // LISTEN/NOTIFY on its own TLS connection.
    idle_relay_wakes_up_fast,
);

/// Every connection of the store's pool is encrypted.
#[tokio::test]
async fn the_store_connections_are_tls() -> anyhow::Result<()> {
    let pg = Pg::isolated_on(&verified()).await?;
    let (ssl,): (bool,) =
        sqlx::query_as("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            .fetch_one(&pg.pool)
            .await?;
    assert!(ssl);
    Ok(())
}

async fn connect_error(url: &str) -> String {
    match sqlx::PgPool::connect(url).await {
        Ok(_) => panic!("connected with {url}"),
        Err(e) => format!("{e}"),
    }
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused() {
    let text = connect_error(&postgres_url("verify-full", "rogue-ca")).await;
    assert!(
        text.contains("invalid peer certificate: UnknownIssuer"),
        "{text}"
    );
}

#[tokio::test]
async fn a_plaintext_connection_is_rejected_by_the_server() {
    let text = connect_error(&postgres_url("disable", "ca")).await;
    assert!(text.contains("no encryption"), "{text}");
}

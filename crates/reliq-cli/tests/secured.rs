//! The `reliq` command against the secured set (`scripts/brokers secure up`): the
//! permissions it prints for a consumer, applied as the only grants of its user — a
//! SCRAM user's ACLs on Kafka, a certificate user's regexes on a RabbitMQ vhost, a NATS
//! user's subjects (a credentials file) — are
//! enough for that consumer to run and for `reliq dlq`, `reliq topology check` and
//! `reliq admin serve` to work on it with the same URL: from `--url-file` (the password
//! is never on the command line), or signing in with the client certificate alone.

mod support;

use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use reliq_core::Broker;
use reliq_integration::secure::{
    admin_url, apply, mint_nats_user, msk_iam_url, nats_auth_file, nats_url, rabbit_admin_url,
    rabbit_management, rabbit_mtls_url, rabbit_permission_words, rabbit_vhost, scram_url,
};
use reliq_integration::settings;
use support::{Server, consumer, dlq, json, park, reliq, run, token, unique, wait_as_planned};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn printed_permissions_are_enough_for_the_consumer_and_the_operator() -> anyhow::Result<()> {
    let user = settings::get("KAFKA_SECURE_SCRAM_USER");
    let password = settings::get("KAFKA_SECURE_SCRAM_PASSWORD");
    // Per-test group ids, which the printed grants name.
    let url = format!(
        "{}&reliq.group.prefix={}.",
        scram_url(&user, &password),
        unique("cli")
    );
    let url_file = tempfile::NamedTempFile::new()?;
    std::fs::write(url_file.path(), format!("{url}\n"))?;
    let url_arg = url_file.path().to_string_lossy().into_owned();
    let (name, source) = (unique("sec"), unique("sec-src"));
    reliq::kafka::KafkaBroker::connect(&admin_url())?
        .ensure_topics(std::slice::from_ref(&source))
        .await?;

    // Every command with the same credentials, from the file.
    let target = |args: &[&str]| on_url_file(&url_arg, &name, &source, args);
    // What the consumer and its operator need, printed; applied as printed.
    let principal = format!("User:{user}");
    let mut permissions = target(&["topology", "permissions", "--retry-tiers", "1s"]);
    permissions.args([
        "--principal",
        &principal,
        "--publish",
        &source,
        "--operator",
    ]);
    let (code, document, err) = run(&mut permissions)?;
    ensure!(code == 0, "exit {code}: {err}");
    ensure!(
        !document.contains(&password) && !err.contains(&password),
        "{document}{err}"
    );
    ensure!(
        document.contains(&format!(
            "--topic {source}.{name}.retry. --resource-pattern-type prefixed"
        )),
        "{document}"
    );
    apply(&document).await?;

    // The consumer runs with those grants only: six dead letters parked.
    let broker: Arc<dyn Broker> = reliq::connect(&url).await?;
    let (handle, _) = consumer(broker.clone(), &name, &source).await?;
    park(&broker, &handle, &source, 6, Duration::from_secs(60)).await?;

    let stats = json(&mut target(&["dlq", "stats", "--json"]), 0)?;
    ensure!(stats["count"] == 6, "{stats}");
    let page = json(&mut target(&["dlq", "ls", "--json", "--max", "10"]), 0)?;
    ensure!(
        page["entries"].as_array().map(Vec::len) == Some(6),
        "{page}"
    );
    wait_as_planned(|| {
        target(&[
            "topology",
            "check",
            "--retry-tiers",
            "1s",
            "--fail-on",
            "any",
        ])
    })
    .await?;
    handle.shutdown().await;
    Ok(())
}

/// A wrong password: the command fails fast (exit 1), names the cause, shows no secret.
#[test]
fn a_refused_login_fails_fast_and_shows_no_secret() -> anyhow::Result<()> {
    let user = settings::get("KAFKA_SECURE_SCRAM_USER");
    let url = scram_url(&user, "not-the-password");
    let started = std::time::Instant::now();
    let (code, out, err) = run(reliq().args([
        "dlq",
        "stats",
        "--url",
        &url,
        "--consumer",
        "c",
        "--source",
        &unique("none"),
    ]))?;
    ensure!(code == 1, "exit {code}: {out}{err}");
    ensure!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    ensure!(err.contains("SASL authentication"), "{err}");
    ensure!(
        !err.contains("not-the-password") && !out.contains("not-the-password"),
        "{err}"
    );
    Ok(())
}

/// `reliq` signed in with AWS MSK IAM (the secured node's MSK IAM stand-in listener): the
/// AWS chain's environment keys sign the token; `topology permissions` prints the IAM
/// policy MSK needs instead of ACLs.
#[test]
fn msk_iam_signs_the_command_in_and_permissions_print_an_iam_policy() -> anyhow::Result<()> {
    let msk = |args: &[&str]| {
        let mut cmd = reliq();
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("AWS_")) {
            cmd.env_remove(k);
        }
        cmd.env(
            "AWS_ACCESS_KEY_ID",
            settings::get("KAFKA_SECURE_MSK_IAM_KEY"),
        )
        .env(
            "AWS_SECRET_ACCESS_KEY",
            settings::get("KAFKA_SECURE_MSK_IAM_SECRET"),
        )
        .env("AWS_CONFIG_FILE", "/nonexistent/reliq-test/config")
        .env(
            "AWS_SHARED_CREDENTIALS_FILE",
            "/nonexistent/reliq-test/credentials",
        )
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .args(args)
        .args(["--url", &msk_iam_url(), "--consumer", "billing"]);
        cmd
    };
    // Signed in, the broker answers about the topic itself: this consumer never
    // subscribed, so it has no DLQ (exit 4) — a refused sign-in would fail (exit 1).
    let source = unique("msk-src");
    let (code, _, err) = run(&mut msk(&["dlq", "stats", "--json", "--source", &source]))?;
    ensure!(
        code == 4 && err.contains(&format!("topic `{source}.billing.dlq` does not exist")),
        "exit {code}: {err}"
    );

    let (code, policy, err) = run(&mut msk(&[
        "topology",
        "permissions",
        "--source",
        "orders",
        "--retry-tiers",
        "1s",
        "--operator",
    ]))?;
    ensure!(code == 0, "exit {code}: {err}");
    let policy: serde_json::Value = serde_json::from_str(&policy)?;
    let statements = policy["Statement"].as_array().cloned().unwrap_or_default();
    let actions_on = |resource: &str| {
        statements
            .iter()
            .find(|s| s["Resource"] == resource)
            .map(|s| s["Action"].clone())
    };
    let region = reliq_integration::secure::MSK_IAM_REGION;
    ensure!(
        actions_on(&format!("arn:aws:kafka:{region}:*:cluster/*/*"))
            == Some(serde_json::json!([
                "kafka-cluster:Connect",
                "kafka-cluster:WriteDataIdempotently"
            ])),
        "{policy:#}"
    );
    ensure!(
        actions_on(&format!(
            "arn:aws:kafka:{region}:*:topic/*/*/orders.billing.retry.*"
        ))
        .is_some(),
        "{policy:#}"
    );
    Ok(())
}

/// RabbitMQ: the admin prints the certificate user's regexes (computed from the plan,
/// with a URL that can connect before the grant) and applies them as printed; then the
/// consumer, `reliq dlq` and `reliq admin serve` all sign in with the client certificate
/// (EXTERNAL) on that vhost — no password anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_certificate_user_runs_consumer_dlq_and_admin_server_on_printed_regexes()
-> anyhow::Result<()> {
    let vhost = unique("cli");
    let api = rabbit_management()?;
    rabbit_vhost(&api, &vhost).await?;
    let (name, source) = (unique("sec"), unique("sec-src"));
    let user = settings::get("KAFKA_SECURE_MTLS_USER");
    let admin_file = tempfile::NamedTempFile::new()?;
    std::fs::write(admin_file.path(), rabbit_admin_url(&vhost))?;
    let (code, document, err) = run(&mut on_url_file(
        &admin_file.path().to_string_lossy(),
        &name,
        &source,
        &[
            "topology",
            "permissions",
            "--retry-tiers",
            "1s",
            "--principal",
            &user,
            "--publish",
            &source,
            "--operator",
        ],
    ))?;
    ensure!(code == 0, "exit {code}: {err}");
    ensure!(
        !document.contains(&settings::get("RABBITMQ_SECURE_ADMIN_PASSWORD")),
        "{document}"
    );
    let [v, u, configure, write, read] = rabbit_permission_words(&document)?;
    ensure!(v == vhost && u == user, "{document}");
    api.put(
        &format!(
            "/api/permissions/{}/{}",
            reliq::rabbit::encode_segment(&v),
            reliq::rabbit::encode_segment(&u)
        ),
        &serde_json::json!({"configure": configure, "write": write, "read": read}),
    )
    .await?;

    let url = rabbit_mtls_url(&vhost, "reliq-mtls");
    let broker: Arc<dyn Broker> = reliq::connect(&url).await?;
    let (handle, _) = consumer(broker.clone(), &name, &source).await?;
    park(&broker, &handle, &source, 6, Duration::from_secs(60)).await?;
    let stats = json(&mut dlq(&url, &name, &source, &["stats", "--json"]), 0)?;
    ensure!(stats["count"] == 6, "{stats}");
    let page = json(
        &mut dlq(&url, &name, &source, &["ls", "--json", "--max", "10"]),
        0,
    )?;
    ensure!(
        page["entries"].as_array().map(Vec::len) == Some(6),
        "{page}"
    );

    // The admin server on the same URL reads the same dead letters.
    let served = served_dead_letters(&url, &name, &source).await?;
    ensure!(served == 6, "the admin server counts {served}");
    handle.shutdown().await;
    Ok(())
}

/// NATS with decentralized auth: the subjects `reliq topology permissions --json` prints
/// for the consumer and its operator become the only permissions of a user minted for
/// the test (its credentials file); the consumer, `reliq dlq`, `reliq topology check` and
/// `reliq admin serve` all sign in with that file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_creds_user_runs_consumer_dlq_topology_and_admin_server_on_printed_subjects()
-> anyhow::Result<()> {
    let (name, source) = (unique("sec"), unique("sec-src"));
    let account = nats_url("jwt", &format!("creds={}", nats_auth_file("reliq.creds")));
    let printed = json(
        reliq().args([
            "topology",
            "permissions",
            "--url",
            &account,
            "--consumer",
            &name,
            "--source",
            &source,
            "--retry-tiers",
            "1s",
            "--publish",
            &source,
            "--operator",
            "--json",
        ]),
        0,
    )?;
    // The grants as printed: each subject with the operations it is granted for.
    let granted = |op: &str| -> Vec<serde_json::Value> {
        printed["grants"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|g| {
                g["operations"]
                    .as_array()
                    .is_some_and(|o| o.contains(&op.into()))
            })
            .map(|g| g["name"].clone())
            .collect()
    };
    let subjects =
        serde_json::json!({"publish": granted("publish"), "subscribe": granted("subscribe")});
    ensure!(
        subjects["publish"]
            .as_array()
            .is_some_and(|p| !p.is_empty()),
        "{printed:#}"
    );
    let creds = mint_nats_user(&name, &subjects).await?;
    let url = nats_url("jwt", &format!("creds={}", creds.display()));
    let url_file = tempfile::NamedTempFile::new()?;
    std::fs::write(url_file.path(), format!("{url}\n"))?;
    let url_arg = url_file.path().to_string_lossy().into_owned();

    let broker: Arc<dyn Broker> = reliq::connect(&url).await?;
    let (handle, _) = consumer(broker.clone(), &name, &source).await?;
    park(&broker, &handle, &source, 6, Duration::from_secs(60)).await?;
    let target = |args: &[&str]| on_url_file(&url_arg, &name, &source, args);
    let stats = json(&mut target(&["dlq", "stats", "--json"]), 0)?;
    ensure!(stats["count"] == 6, "{stats}");
    // As the consumer helper subscribes: two attempts (a delivery limit of 2 + 5), 256
    // in flight.
    wait_as_planned(|| {
        target(&[
            "topology",
            "check",
            "--retry-tiers",
            "1s",
            "--delivery-limit",
            "7",
            "--prefetch",
            "256",
            "--fail-on",
            "any",
        ])
    })
    .await?;
    let served = served_dead_letters(&url, &name, &source).await?;
    ensure!(served == 6, "the admin server counts {served}");
    handle.shutdown().await;
    Ok(())
}

/// `reliq admin serve` on `url` for consumer `name` of `source`: the dead-letter count
/// its API answers a reader with.
async fn served_dead_letters(url: &str, name: &str, source: &str) -> anyhow::Result<u64> {
    let reader = token("rita-reader", "reader", None)?;
    let dir = tempfile::tempdir()?;
    let (tokens, audit) = (
        dir.path().join("tokens.toml"),
        dir.path().join("audit.jsonl"),
    );
    std::fs::write(&tokens, &reader.entry)?;
    let server = Server::start(url, &format!("{name}={source}"), &tokens, &audit)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let served = reqwest::Client::new()
        .get(format!(
            "{}/v1/consumers/{name}/dlq/stats?source={source}",
            server.base
        ))
        .bearer_auth(&reader.secret)
        .send()
        .await?;
    let status = served.status();
    let body: serde_json::Value = served.json().await?;
    let log = server.stop()?;
    ensure!(status == 200, "{status}: {body}\n{log}");
    body["count"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no count: {body}"))
}

/// `reliq ARGS --url-file URL_FILE --consumer NAME --source SOURCE`: a command with the
/// URL (and its secrets) from a file.
fn on_url_file(url_file: &str, name: &str, source: &str, args: &[&str]) -> std::process::Command {
    let mut cmd = reliq();
    cmd.args(args).args([
        "--url-file",
        url_file,
        "--consumer",
        name,
        "--source",
        source,
    ]);
    cmd
}

//! The AWS default credential chain of the SQS backend, exercised on moto (the local
//! endpoint from `scripts/brokers`, which serves STS and IAM on the same port): every
//! source the chain reads, the STS calls going to the connection's endpoint, and the
//! errors a broken source gives.
//!
//! How a test knows which credentials signed the SQS calls: moto keeps the queues of
//! each account apart and takes the account from the access key. Keys moto's STS issued
//! for a role of account `A` (`ASIA…`) create their queues under
//! `http://127.0.0.1:4566/A/…`; keys it never issued fall into its default account
//! `123456789012`. So a queue URL names the account whose credentials signed
//! `CreateQueue`, and STS `GetCallerIdentity` names the role and session.
//!
//! Every test sets the `AWS_*` environment it needs — after clearing whatever the
//! machine has — before it starts its runtime (see `reliq_integration::aws_env::Env`).

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use reliq_conformance::support::{Recorder, unique, wait_until};
use reliq_core::{Access, Broker, BrokerError, Consumer, Destination, Message, Subscription};
use reliq_integration::aws_env::{Env, runtime};
use reliq_integration::settings;
use reliq_sqs::SqsBroker;

/// moto's account for keys it did not issue.
const DEFAULT_ACCOUNT: &str = "123456789012";

fn base_url() -> String {
    settings::get("RELIQ_SQS_URL")
}

fn endpoint() -> String {
    format!("http://{}", settings::authority(&base_url()))
}

/// `base_url()` plus `&options`.
fn url_with(options: &str) -> String {
    let base = base_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}{options}")
}

/// Temporary credentials (key, secret, session token) moto's STS issues for a role of
/// `account`, fetched on a runtime of its own that is gone when this returns (so the
/// test may change its environment afterwards).
fn moto_session(account: &str, role: &str) -> anyhow::Result<(String, String, String)> {
    use aws_smithy_http_client::{Builder, tls};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let endpoint = endpoint();
    let arn = format!("arn:aws:iam::{account}:role/{role}");
    let creds = rt.block_on(async move {
        let http = Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let conf = aws_sdk_sts::Config::builder()
            .behavior_version(aws_sdk_sts::config::BehaviorVersion::latest())
            .http_client(http)
            .region(aws_sdk_sts::config::Region::new("us-east-1"))
            .endpoint_url(endpoint)
            .credentials_provider(aws_sdk_sts::config::Credentials::new(
                "AKIAMOTOADMIN0000000",
                "moto",
                None,
                None,
                "test",
            ))
            .build();
        let out = aws_sdk_sts::Client::from_conf(conf)
            .assume_role()
            .role_arn(arn)
            .role_session_name("reliq-setup")
            .send()
            .await
            .context("moto STS AssumeRole")?;
        out.credentials
            .context("AssumeRole returned no credentials")
    })?;
    drop(rt);
    Ok((
        creds.access_key_id,
        creds.secret_access_key,
        creds.session_token,
    ))
}

/// The account whose credentials signed `broker`'s calls: the account in the URL of a
/// queue it creates (see the module docs).
async fn signing_account(broker: &SqsBroker) -> anyhow::Result<String> {
    let sub = Subscription::new("c", unique("credentials"));
    let url = broker.declare_dead_letters(&sub).await?;
    let path = url
        .strip_prefix(&endpoint())
        .with_context(|| format!("queue url {url}"))?;
    Ok(path
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// The access key id SQS calls are signed with.
async fn signing_key(broker: &SqsBroker) -> anyhow::Result<String> {
    Ok(broker.signing_key_id().await?)
}

/// (a) Environment keys (with a session token) sign every call.
#[test]
fn environment_keys_sign_the_calls() -> anyhow::Result<()> {
    let env = Env::new()?;
    let (key, secret, token) = moto_session("111111111111", "reliq-env")?;
    env.apply(&[
        ("AWS_ACCESS_KEY_ID", &key),
        ("AWS_SECRET_ACCESS_KEY", &secret),
        ("AWS_SESSION_TOKEN", &token),
    ])?;
    runtime()?.block_on(async {
        let broker = SqsBroker::connect(&base_url()).await?;
        ensure!(
            signing_key(&broker).await? == key,
            "not the environment's key"
        );
        ensure!(signing_account(&broker).await? == "111111111111");
        let me = broker.caller_identity().await?;
        ensure!(
            me.arn == "arn:aws:sts::111111111111:assumed-role/reliq-env/reliq-setup",
            "{me:?}"
        );
        Ok(())
    })
}

/// (b) A shared profile: `profile=` in the URL wins over `AWS_PROFILE`, which selects the
/// profile otherwise.
#[test]
fn a_shared_profile_signs_the_calls() -> anyhow::Result<()> {
    let env = Env::new()?;
    let chosen = moto_session("222222222222", "reliq-profile")?;
    let other = moto_session("333333333333", "reliq-profile")?;
    env.apply(&[("AWS_PROFILE", "other")])?;
    let profile = |name: &str, (key, secret, token): &(String, String, String)| {
        format!(
            "[{name}]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\naws_session_token = {token}\n"
        )
    };
    env.write(
        "credentials",
        &(profile("chosen", &chosen) + &profile("other", &other)),
    )?;
    runtime()?.block_on(async {
        let broker = SqsBroker::connect(&url_with("profile=chosen")).await?;
        ensure!(signing_key(&broker).await? == chosen.0);
        ensure!(signing_account(&broker).await? == "222222222222");
        let broker = SqsBroker::connect(&base_url()).await?;
        ensure!(
            signing_key(&broker).await? == other.0,
            "AWS_PROFILE ignored"
        );
        ensure!(signing_account(&broker).await? == "333333333333");
        Ok(())
    })
}

/// (c) A profile with `role_arn` + `source_profile`: STS `AssumeRole` at moto (the URL's
/// endpoint is STS's too), then a consumer runs on the assumed role's credentials; the
/// generated policy names the role's account.
#[test]
fn assume_role_from_a_profile_goes_to_the_endpoints_sts() -> anyhow::Result<()> {
    let env = Env::set(&[])?;
    env.write(
        "config",
        "[profile base]\n\
         aws_access_key_id = AKIARELIQBASE0000001\n\
         aws_secret_access_key = base-secret-do-not-print\n\
         [profile app]\n\
         role_arn = arn:aws:iam::444444444444:role/reliq-app\n\
         source_profile = base\n\
         role_session_name = reliq-app-session\n\
         [profile broken]\n\
         role_arn = arn:aws:iam::444444444444:role/reliq-app\n\
         source_profile = missing\n",
    )?;
    runtime()?.block_on(async {
        let broker = SqsBroker::connect(&url_with("profile=app")).await?;
        let key = signing_key(&broker).await?;
        ensure!(key.starts_with("ASIA"), "not STS's temporary key: {key}");
        ensure!(signing_account(&broker).await? == "444444444444");
        let me = broker.caller_identity().await?;
        ensure!(
            me.arn == "arn:aws:sts::444444444444:assumed-role/reliq-app/reliq-app-session",
            "{me:?}"
        );

        // A consumer on the assumed role: subscribe, publish, handle, ack.
        let broker: std::sync::Arc<dyn Broker> = std::sync::Arc::new(broker);
        let topic = unique("assumed");
        let rec = Recorder::new();
        let h = Consumer::builder(broker.clone(), "c")
            .subscribe(topic.clone())
            .start(rec.succeeding())
            .await?;
        broker
            .publish(
                &Destination::new(topic.clone()),
                Message::new("on the role"),
            )
            .await?;
        wait_until("handled", Duration::from_secs(30), || {
            rec.effect_count() == 1
        })
        .await?;
        let stats = h.shutdown().await.stats;
        ensure!(stats.processed == 1, "{stats:?}");

        // The policy's ARNs are in the role's account (STS GetCallerIdentity).
        let policy = broker
            .permissions(&Access::consumer(Subscription::new("c", topic.clone())))
            .await?;
        ensure!(
            policy
                .document
                .contains(&format!("arn:aws:sqs:us-east-1:444444444444:{topic}-c\"")),
            "{}",
            policy.document
        );

        // A source profile that does not exist: the first call names it.
        let broken = SqsBroker::connect(&url_with("profile=broken")).await?;
        let err = broken
            .declare_dead_letters(&Subscription::new("c", unique("broken")))
            .await
            .expect_err("no credentials for a broken profile");
        let text = reliq_core::ErrorChain(&err).to_string();
        ensure!(matches!(err, BrokerError::Unauthorized { .. }), "{err:?}");
        ensure!(text.contains("missing"), "{text}");
        ensure!(!text.contains("base-secret-do-not-print"), "{text}");
        Ok(())
    })
}

/// (c') `sts_endpoint=` moves the chain's STS calls: to a port where nothing listens, the
/// assume-role profile cannot get credentials — proof that the call goes where the URL
/// says, and an unreachable STS is a connection error (another try may work).
#[test]
fn sts_endpoint_moves_the_sts_calls() -> anyhow::Result<()> {
    let env = Env::set(&[("AWS_PROFILE", "app")])?;
    env.write(
        "config",
        "[profile base]\n\
         aws_access_key_id = AKIARELIQBASE0000001\n\
         aws_secret_access_key = base-secret\n\
         [profile app]\n\
         role_arn = arn:aws:iam::444444444444:role/reliq-app\n\
         source_profile = base\n",
    )?;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    runtime()?.block_on(async {
        let broker =
            SqsBroker::connect(&url_with(&format!("sts_endpoint=http://{closed}"))).await?;
        let err = broker
            .declare_dead_letters(&Subscription::new("c", unique("sts-down")))
            .await
            .expect_err("STS is not there");
        ensure!(matches!(err, BrokerError::Connection { .. }), "{err:?}");
        ensure!(err.to_string().contains("AWS credentials"), "{err}");
        Ok(())
    })
}

/// (d) Web identity from the environment (EKS IRSA): STS `AssumeRoleWithWebIdentity` at
/// moto with the token file's token.
#[test]
fn web_identity_goes_to_the_endpoints_sts() -> anyhow::Result<()> {
    let env = Env::new()?;
    let token = env.write("token", "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJyZWxpcSJ9.c2ln")?;
    env.apply(&[
        ("AWS_ROLE_ARN", "arn:aws:iam::555555555555:role/reliq-irsa"),
        ("AWS_ROLE_SESSION_NAME", "reliq-irsa-session"),
        ("AWS_WEB_IDENTITY_TOKEN_FILE", &token),
    ])?;
    runtime()?.block_on(async {
        let broker = SqsBroker::connect(&base_url()).await?;
        let key = signing_key(&broker).await?;
        ensure!(key.starts_with("ASIA"), "not STS's temporary key: {key}");
        ensure!(signing_account(&broker).await? == "555555555555");
        let me = broker.caller_identity().await?;
        ensure!(
            me.arn == "arn:aws:sts::555555555555:assumed-role/reliq-irsa/reliq-irsa-session",
            "{me:?}"
        );
        Ok(())
    })
}

/// (d') A token file that is not there: the first call fails naming it — no fall-back to
/// the emulator placeholder, although the endpoint is plain http.
#[test]
fn a_missing_web_identity_token_file_is_named() -> anyhow::Result<()> {
    let env = Env::new()?;
    let missing = env.path("no-such-token")?;
    env.apply(&[
        ("AWS_ROLE_ARN", "arn:aws:iam::555555555555:role/reliq-irsa"),
        ("AWS_WEB_IDENTITY_TOKEN_FILE", &missing),
    ])?;
    runtime()?.block_on(async {
        let broker = SqsBroker::connect(&base_url()).await?;
        let err = broker
            .declare_dead_letters(&Subscription::new("c", unique("no-token")))
            .await
            .expect_err("no token, no credentials");
        ensure!(matches!(err, BrokerError::Unauthorized { .. }), "{err:?}");
        let text = err.to_string();
        ensure!(text.contains("no-such-token"), "{text}");
        Ok(())
    })
}

/// (e) Keys in the URL (emulators only) win over the chain; they never show in `Debug`
/// or errors.
#[test]
fn url_keys_win_and_stay_secret() -> anyhow::Result<()> {
    let env = Env::new()?;
    let (key, secret, token) = moto_session("666666666666", "reliq-env")?;
    env.apply(&[
        ("AWS_ACCESS_KEY_ID", &key),
        ("AWS_SECRET_ACCESS_KEY", &secret),
        ("AWS_SESSION_TOKEN", &token),
    ])?;
    let url = base_url().replacen("sqs://", "sqs://AKIARELIQURL00000001:url-secret-xyz@", 1);
    runtime()?.block_on(async {
        let broker = SqsBroker::connect(&url).await?;
        ensure!(signing_key(&broker).await? == "AKIARELIQURL00000001");
        ensure!(signing_account(&broker).await? == DEFAULT_ACCOUNT);
        ensure!(!format!("{broker:?}").contains("url-secret-xyz"));
        let err = SqsBroker::connect(&format!("{url}&bogus=1"))
            .await
            .expect_err("unknown option");
        ensure!(
            !format!("{err} {err:?}").contains("url-secret-xyz"),
            "{err:?}"
        );
        Ok(())
    })
}

/// Nothing configures the chain: an emulator's plain-http endpoint signs with the
/// placeholder (as the rest of the SQS suite relies on); over https, on AWS, or with a
/// profile asked for that does not exist, the first call fails saying so.
#[test]
fn no_credentials_is_the_placeholder_only_for_an_emulator() -> anyhow::Result<()> {
    let _env = Env::set(&[])?;
    runtime()?.block_on(async {
        let broker = SqsBroker::connect(&base_url()).await?;
        ensure!(signing_key(&broker).await? == "reliq");
        ensure!(signing_account(&broker).await? == DEFAULT_ACCOUNT);
        for url in [
            url_with("tls=true"),
            "sqs://?region=us-east-1".to_owned(),
            // A profile asked for is configuration: no placeholder, even for an emulator.
            url_with("profile=absent"),
        ] {
            let broker = SqsBroker::connect(&url).await?;
            let err = match broker
                .declare_dead_letters(&Subscription::new("c", unique("nothing")))
                .await
            {
                Ok(queue) => bail!("{url}: declared {queue} without credentials"),
                Err(e) => e,
            };
            ensure!(
                matches!(err, BrokerError::Unauthorized { .. }),
                "{url}: {err:?}"
            );
            let text = err.to_string();
            ensure!(
                text.contains("no credentials from the default chain")
                    || text.contains("the selected profile `absent` gives no credentials"),
                "{url}: {err}"
            );
        }
        Ok(())
    })
}

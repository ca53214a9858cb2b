//! The web console in a real headless Chromium (Debian's `chromium` and `chromedriver`,
//! installed by `scripts/brokers browser`), against the admin server and a broker — the
//! embedded one, RabbitMQ and Kafka: sign in; the group a run of poison messages made, with its
//! count; a message's payload and reason; a dry-run group replay that changes nothing; the
//! replay at a rate, its job finished and the consumer's count up by exactly that many;
//! edit-and-replay; a purge; a reader who finds no action and whose forged post is refused;
//! a post without the CSRF token refused; sign-out; a payload with a script in it shown as
//! text and run by nothing (the content security policy). Each step saves a screenshot to
//! `<target>/console-screenshots/`.

mod support;

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use fantoccini::{Client, ClientBuilder, Locator};
use reliq_admin::http::{AdminState, Limits, router};
use reliq_admin::{AuditLog, Role, Tokens, new_token};
use reliq_core::{Broker, Destination, Message, Subscription, seam::RetryRequest};
use support::{Effects, consumer_failing, park, unique, url, wait_for};

/// chromedriver on a free port, killed on drop.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn driver() -> anyhow::Result<Driver> {
    let port = free_port()?;
    let child = std::process::Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting chromedriver (scripts/brokers browser installs it)")?;
    let driver = Driver {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(driver);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("chromedriver did not listen on {port}")
}

/// A headless Chromium session, with the flags a closed network needs (no background
/// connections, no component updates) and a fresh profile.
async fn browser(driver: &Driver, profile: &std::path::Path) -> anyhow::Result<Client> {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    Ok(ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&driver.url)
        .await?)
}

/// An admin server on a free port for `consumers`, with a reader's, an operator's and an
/// admin's token (the tokens file and the browser profile live in `dir`).
struct Served {
    base: String,
    reader: String,
    operator: String,
    admin: String,
    dir: tempfile::TempDir,
}

async fn serve(broker: Arc<dyn Broker>, consumers: Vec<Subscription>) -> anyhow::Result<Served> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let audit = AuditLog::tracing_only();
    serve_on(listener, broker, consumers, audit, Ok).await
}

/// [`serve`] on `listener`, auditing to `audit`, with `configure` adding to the state.
async fn serve_on(
    listener: tokio::net::TcpListener,
    broker: Arc<dyn Broker>,
    consumers: Vec<Subscription>,
    audit: AuditLog,
    configure: impl FnOnce(AdminState) -> anyhow::Result<AdminState>,
) -> anyhow::Result<Served> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    let (reader, reader_entry) = new_token("rita", Role::Reader, None)?;
    let (operator, operator_entry) = new_token("oscar", Role::Operator, None)?;
    let (admin, admin_entry) = new_token("ada", Role::Admin, None)?;
    std::fs::write(
        &tokens,
        format!("{reader_entry}\n{operator_entry}\n{admin_entry}"),
    )?;
    let triage = reliq_admin::TriageStore::open(&dir.path().join("triage.sqlite")).await?;
    let state = AdminState::new(broker, Tokens::open(&tokens)?, audit)
        .with_consumers(consumers)
        .with_triage(triage);
    let state = configure(state)?;
    let base = format!("http://{}", listener.local_addr()?);
    let app = router(Arc::new(state), Limits::default());
    tokio::spawn(async move {
        let _ = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await;
    });
    Ok(Served {
        base,
        reader,
        operator,
        admin,
        dir,
    })
}

struct Shots {
    dir: std::path::PathBuf,
    backend: &'static str,
}

impl Shots {
    /// Screenshots of `backend`'s test, in `<target>/console-screenshots/`.
    fn new(backend: &'static str) -> anyhow::Result<Self> {
        let target = std::env::var("CARGO_TARGET_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| "target".into());
        let dir = target.join("console-screenshots");
        std::fs::create_dir_all(&dir)?;
        Ok(Self { dir, backend })
    }

    async fn take(&self, c: &Client, name: &str) -> anyhow::Result<()> {
        let png = c.screenshot().await?;
        ensure!(
            png.starts_with(b"\x89PNG"),
            "a screenshot that is not a PNG"
        );
        std::fs::write(self.dir.join(format!("{}-{name}.png", self.backend)), png)?;
        Ok(())
    }
}

/// The element `locator` finds, waiting up to 20 s for it: a click that submits a form
/// returns before the next page has loaded, and a busy machine takes its time.
async fn el(c: &Client, locator: Locator<'_>) -> anyhow::Result<fantoccini::elements::Element> {
    Ok(c.wait()
        .at_most(Duration::from_secs(20))
        .for_element(locator)
        .await?)
}

async fn sign_in(c: &Client, base: &str, token: &str) -> anyhow::Result<()> {
    c.goto(&format!("{base}/console/sign-in")).await?;
    el(c, Locator::Css("#token"))
        .await?
        .send_keys(token)
        .await?;
    el(c, Locator::Css("button[type=submit]"))
        .await?
        .click()
        .await?;
    c.wait().for_element(Locator::Css("nav")).await?;
    Ok(())
}

async fn sign_out(c: &Client) -> anyhow::Result<()> {
    el(c, Locator::XPath("//button[normalize-space()='Sign out']"))
        .await?
        .click()
        .await?;
    c.wait().for_element(Locator::Css("#token")).await?;
    Ok(())
}

/// Click the button whose text starts with `text` in the table row holding `row_text`.
async fn click_in_row(c: &Client, row_text: &str, text: &str) -> anyhow::Result<()> {
    let xpath = format!(
        "//tr[contains(., '{row_text}')]//button[starts-with(normalize-space(), '{text}')]"
    );
    el(c, Locator::XPath(&xpath)).await?.click().await?;
    Ok(())
}

async fn wait_for_job(c: &Client) -> anyhow::Result<String> {
    for _ in 0..120 {
        let state = el(c, Locator::Css("[data-testid=job-state]"))
            .await?
            .text()
            .await?;
        if state != "running" {
            return Ok(state);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        c.refresh().await?;
    }
    bail!("the job still runs after a minute")
}

/// A second consumer, not running, with a backlog at the broker: 3 published, one of
/// them retried on its 10-minute tier (so it waits there for the whole test), the others
/// given back when its receiver closed.
async fn idle_consumer_with_a_retry(broker: &Arc<dyn Broker>) -> anyhow::Result<Subscription> {
    let tier = Duration::from_secs(600);
    let mut sub = Subscription::new(unique("idle"), unique("idle-src"));
    sub.retry_tiers = vec![tier];
    let receiver = broker.subscribe(&sub).await?;
    for i in 0..3 {
        broker
            .publish(
                &Destination::new(sub.source.clone()),
                Message::new(format!("idle-{i}")),
            )
            .await?;
    }
    let d = tokio::time::timeout(Duration::from_secs(30), receiver.receive())
        .await
        .context("the idle consumer's first delivery")??;
    receiver
        .retry(
            &d,
            RetryRequest {
                message: d.message().clone(),
                delay: tier,
                tier: 0,
            },
        )
        .await?;
    receiver.close().await?;
    Ok(sub)
}

/// The text of the overview's `column` cell in `consumer`'s row.
async fn overview_cell(c: &Client, consumer: &str, column: &str) -> anyhow::Result<String> {
    Ok(el(
        c,
        Locator::XPath(&format!(
            "//tr[@data-consumer='{consumer}']/td[contains(@class, '{column}')]"
        )),
    )
    .await?
    .text()
    .await?)
}

async fn console_in_a_browser(backend: &'static str) -> anyhow::Result<()> {
    let broker: Arc<dyn Broker> = match backend {
        "memory" => Arc::new(reliq_memory::MemoryBroker::new()),
        // The management API named in the URL, so the overview has RabbitMQ's unacked.
        "rabbit" => {
            let mgmt = reqwest::Url::parse(&url("rabbit_mgmt"))?;
            let port = mgmt.port().context("the management URL's port")?;
            reliq::connect(&format!("{}?reliq.management={port}", url("rabbit"))).await?
        }
        other => reliq::connect(&url(other)).await?,
    };
    let (name, source) = (unique("console"), unique("console-src"));
    // A run of poison messages.
    let (handle, effects): (_, Effects) =
        consumer_failing(broker.clone(), &name, &source, true).await?;
    park(&broker, &handle, &source, 5, Duration::from_secs(60)).await?;
    let mut sub = Subscription::new(name.clone(), source.clone());
    sub.retry_tiers = vec![Duration::from_secs(1)]; // consumer_failing's policy
    let idle = idle_consumer_with_a_retry(&broker).await?;
    let depth = async || -> anyhow::Result<u64> {
        Ok(broker.dead_letters(&sub).await?.count().await?.count)
    };

    let Served {
        base,
        reader,
        operator,
        admin,
        dir,
    } = serve(broker.clone(), vec![sub.clone(), idle.clone()]).await?;
    let shots = Shots::new(backend)?;
    let driver = driver().await?;
    let c = browser(&driver, &dir.path().join("profile")).await?;
    let result = async {
        // An operator signs in and sees the consumer with its 5 dead letters.
        sign_in(&c, &base, &operator).await?;
        let dead = overview_cell(&c, &name, "dead").await?;
        ensure!(dead == "5", "the overview's dead letters: {dead}");
        // The idle consumer's backlog, as the broker tells it (its counters settle within
        // seconds after the receiver closed: RabbitMQ's, Kafka's commit).
        let tiered = !broker.capabilities().exact_retry_delay;
        // Kafka has no in-flight count; RabbitMQ's (management API) and the embedded
        // broker's are 0 once the receiver closed.
        let in_flight = if backend == "kafka" { "—" } else { "0" };
        let expected = |seen: &(String, String, String)| {
            seen.0 == "2"
                && seen.1 == in_flight
                && seen.2.starts_with('1')
                && (!tiered || seen.2.contains("10m: 1"))
        };
        let mut seen = (String::new(), String::new(), String::new());
        for _ in 0..40 {
            seen = (
                overview_cell(&c, &idle.consumer, "waiting").await?,
                overview_cell(&c, &idle.consumer, "in-flight").await?,
                overview_cell(&c, &idle.consumer, "retries").await?,
            );
            if expected(&seen) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            c.refresh().await?;
        }
        ensure!(
            expected(&seen),
            "the idle consumer's backlog (waiting, in flight, retries): {seen:?}"
        );
        shots.take(&c, "overview").await?;
        el(&c, Locator::LinkText(&name)).await?.click().await?;
        let group = el(
            &c,
            Locator::XPath("//tr[contains(., 'undecodable field at byte <n>')]"),
        )
        .await?
        .text()
        .await?;
        ensure!(group.starts_with("5 "), "the group row: {group}");
        shots.take(&c, "group").await?;

        // A dry run changes nothing; the replay at a rate ends as a job, +5 exactly.
        click_in_row(&c, "undecodable field at byte <n>", "Preview replay").await?;
        let preview = el(&c, Locator::Css("[data-testid=preview]"))
            .await?
            .text()
            .await?;
        ensure!(
            preview.contains("5 dead letters would be replayed"),
            "{preview}"
        );
        ensure!(
            depth().await? == 5 && effects.count() == 0,
            "a dry run changed something"
        );
        shots.take(&c, "preview").await?;
        c.back().await?;
        click_in_row(&c, "undecodable field at byte <n>", "Replay").await?;
        let state = wait_for_job(&c).await?;
        ensure!(state == "succeeded", "the replay job ended {state}");
        shots.take(&c, "job").await?;
        wait_for(
            "the 5 replayed copies handled",
            Duration::from_secs(30),
            || effects.count() == 5,
        )
        .await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        ensure!(
            effects.count() == 5 && depth().await? == 0,
            "replayed {}, left {}",
            effects.count(),
            depth().await?
        );

        // A message's page: payload and reason; edit and replay it.
        let ids = park(&broker, &handle, &source, 2, Duration::from_secs(60)).await?;
        c.goto(&format!(
            "{base}/console/consumers/{name}/entries?id={}",
            ids[0]
        ))
        .await?;
        el(&c, Locator::Css("td a code")).await?.click().await?;
        let payload = el(&c, Locator::Css("[data-testid=payload]"))
            .await?
            .text()
            .await?;
        ensure!(payload.contains("\"order\": 0"), "payload: {payload}");
        let page = c.source().await?;
        ensure!(
            page.contains("poison") && page.contains("undecodable field at byte 10"),
            "the record is not shown"
        );
        shots.take(&c, "detail").await?;
        let area = el(&c, Locator::Css("#payload")).await?;
        area.clear().await?;
        area.send_keys(r#"{"order":0,"fixed":true}"#).await?;
        el(
            &c,
            Locator::XPath("//button[normalize-space()='Replay the edited copy']"),
        )
        .await?
        .click()
        .await?;
        wait_for("the edited copy handled", Duration::from_secs(30), || {
            effects.count() == 6
        })
        .await?;
        // The copy can be handled before the edit's removal of the original is confirmed
        // (the request answers after both; the click does not wait for the answer).
        let mut left = depth().await?;
        for _ in 0..100 {
            if left == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            left = depth().await?;
        }
        ensure!(
            left == 1,
            "the edited original is still in the DLQ ({left} entries)"
        );

        // A post without the CSRF token is refused.
        let cookie = c
            .get_all_cookies()
            .await?
            .into_iter()
            .find(|k| k.name() == reliq_admin::SESSION_COOKIE)
            .context("the session cookie")?;
        let session = format!("{}={}", cookie.name(), cookie.value());
        ensure!(
            cookie.http_only() == Some(true),
            "the session cookie is readable by scripts"
        );
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::new();
        let forged = http
            .post(format!("{base}/console/consumers/{name}/replay"))
            .header("cookie", &session)
            .header("content-type", "application/x-www-form-urlencoded")
            .body("dry_run=true")
            .send()
            .await?;
        ensure!(
            forged.status() == 403,
            "a post without CSRF: {}",
            forged.status()
        );
        sign_out(&c).await?;
        c.goto(&format!("{base}/console/")).await?;
        ensure!(
            c.current_url().await?.path() == "/console/sign-in",
            "signed out, still in"
        );

        // An admin purges the group.
        sign_in(&c, &base, &admin).await?;
        let state = purge_group(&c, &base, &name, "undecodable field at byte <n>", 1).await?;
        ensure!(
            state == "succeeded" && depth().await? == 0,
            "the purge ended {state}"
        );
        sign_out(&c).await?;

        // A reader finds no action, and a forged post is refused.
        park(&broker, &handle, &source, 1, Duration::from_secs(60)).await?;
        sign_in(&c, &base, &reader).await?;
        c.goto(&format!("{base}/console/consumers/{name}")).await?;
        let buttons: Vec<String> = {
            let mut texts = Vec::new();
            for b in c.find_all(Locator::Css("main button")).await? {
                texts.push(b.text().await?);
            }
            texts
        };
        ensure!(buttons.is_empty(), "a reader sees buttons: {buttons:?}");
        shots.take(&c, "reader").await?;
        let page = c.source().await?;
        let at = page
            .find(r#"name="csrf" value=""#)
            .context("the reader's CSRF token")?
            + r#"name="csrf" value=""#.len();
        let csrf = page[at..at + 64].to_owned();
        let cookie = c
            .get_all_cookies()
            .await?
            .into_iter()
            .find(|k| k.name() == reliq_admin::SESSION_COOKIE)
            .context("cookie")?;
        let forged = http
            .post(format!("{base}/console/consumers/{name}/replay"))
            .header("cookie", format!("{}={}", cookie.name(), cookie.value()))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("csrf={csrf}"))
            .send()
            .await?;
        ensure!(
            forged.status() == 403,
            "a reader's forged replay: {}",
            forged.status()
        );
        ensure!(
            depth().await? == 1 && effects.count() == 6,
            "the forged replay moved something"
        );
        sign_out(&c).await?;
        Ok(())
    }
    .await;
    wind_up(&result, &shots, c, handle, "failure").await;
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_browser_on_the_embedded_broker() -> anyhow::Result<()> {
    console_in_a_browser("memory").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_browser_on_rabbitmq() -> anyhow::Result<()> {
    console_in_a_browser("rabbit").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_browser_on_kafka() -> anyhow::Result<()> {
    console_in_a_browser("kafka").await
}

/// Every visible form control of the current page without a label (a `label for`, a
/// wrapping `label`, or `aria-label`): their names.
async fn unlabelled_controls(c: &Client) -> anyhow::Result<Vec<String>> {
    let found = c
        .execute(
            r#"return Array.from(document.querySelectorAll('input, select, textarea'))
                .filter(e => e.type !== 'hidden')
                .filter(e => !(e.id && document.querySelector('label[for="' + e.id + '"]'))
                    && !e.closest('label') && !e.getAttribute('aria-label'))
                .map(e => e.name || e.outerHTML);"#,
            vec![],
        )
        .await?;
    Ok(serde_json::from_value(found)?)
}

/// How far the page scrolls sideways at the current window size (0: it fits; wide
/// tables scroll inside their own box).
async fn sideways_overflow(c: &Client) -> anyhow::Result<i64> {
    let v = c
        .execute(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth;",
            vec![],
        )
        .await?;
    v.as_i64().context("a number")
}

/// The console used by keyboard alone, and at a phone's width: sign in with the token
/// typed and Enter; the skip link is the first Tab stop and lands on the content; Tab
/// reaches the consumer's link and Enter opens it; every form control of the overview,
/// a group, its triage form, a message and its edit form has a label; at 360 px no page scrolls sideways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_by_keyboard_and_at_a_narrow_width() -> anyhow::Result<()> {
    use fantoccini::key::Key;
    let broker: Arc<dyn Broker> = Arc::new(reliq_memory::MemoryBroker::new());
    let (name, source) = (unique("keys"), unique("keys-src"));
    let (handle, _effects) = consumer_failing(broker.clone(), &name, &source, true).await?;
    let ids = park(&broker, &handle, &source, 2, Duration::from_secs(60)).await?;
    let served = serve(
        broker.clone(),
        vec![Subscription::new(name.clone(), source.clone())],
    )
    .await?;
    let shots = Shots::new("memory")?;
    let driver = driver().await?;
    let c = browser(&driver, &served.dir.path().join("profile")).await?;
    let base = served.base.clone();
    let result = async {
        // Sign in without a mouse: the token field has the focus, Enter submits.
        c.goto(&format!("{base}/console/sign-in")).await?;
        let focused = c.active_element().await?;
        ensure!(
            focused.attr("id").await?.as_deref() == Some("token"),
            "the sign-in page does not focus the token field"
        );
        focused
            .send_keys(&format!("{}{}", served.admin, char::from(Key::Enter)))
            .await?;
        el(&c, Locator::Css("nav")).await?;
        // The first Tab stop skips the header and lands on the content.
        let skip = c.active_element().await?;
        skip.send_keys(&char::from(Key::Tab).to_string()).await?;
        let first = c.active_element().await?;
        ensure!(
            first.text().await? == "Skip to content",
            "the first Tab stop: {:?}",
            first.text().await?
        );
        first.send_keys(&char::from(Key::Enter).to_string()).await?;
        ensure!(
            c.active_element().await?.attr("id").await?.as_deref() == Some("main"),
            "the skip link does not move the focus to the content"
        );
        // Tab on to the consumer's link; Enter opens its groups.
        let mut on_link = false;
        for _ in 0..20 {
            c.active_element()
                .await?
                .send_keys(&char::from(Key::Tab).to_string())
                .await?;
            if c.active_element().await?.text().await? == name {
                on_link = true;
                break;
            }
        }
        ensure!(on_link, "Tab never reached the consumer's link");
        c.active_element()
            .await?
            .send_keys(&char::from(Key::Enter).to_string())
            .await?;
        el(
            &c,
            Locator::XPath("//tr[contains(., 'undecodable field at byte <n>')]"),
        )
        .await?;
        let group_page = c.current_url().await?;
        let triage_page = el(&c, Locator::LinkText("Triage"))
            .await?
            .prop("href")
            .await?
            .context("the triage link")?;

        // Labelled controls, and no sideways scrolling at 360 px, on every kind of page.
        let pages = [
            format!("{base}/console/"),
            group_page.to_string(),
            triage_page,
            format!("{base}/console/consumers/{name}/entries"),
            format!("{base}/console/consumers/{name}/entries/{}", ids[0]),
            format!("{base}/console/jobs"),
            format!("{base}/console/audit"),
        ];
        for wide in [true, false] {
            if !wide {
                c.set_window_size(360, 800).await?;
            }
            for page in &pages {
                c.goto(page).await?;
                el(&c, Locator::Css("main h1")).await?;
                let unlabelled = unlabelled_controls(&c).await?;
                ensure!(unlabelled.is_empty(), "{page}: unlabelled {unlabelled:?}");
                if !wide {
                    let overflow = sideways_overflow(&c).await?;
                    ensure!(
                        overflow <= 0,
                        "{page} scrolls {overflow}px sideways at 360px"
                    );
                }
            }
        }
        c.goto(&format!(
            "{base}/console/consumers/{name}/entries/{}",
            ids[0]
        ))
        .await?;
        el(&c, Locator::Css("main h1")).await?;
        shots.take(&c, "narrow-detail").await?;
        Ok(())
    }
    .await;
    wind_up(&result, &shots, c, handle, "keyboard-failure").await;
    result
}

/// A payload that carries markup — a script element, an event handler, a closing tag for
/// the page's own textarea — is shown as text on the message page and nothing in it runs.
/// And should an escape ever slip, the page's policy still runs no inline script: one
/// added to the page is refused by the browser (a `securitypolicyviolation`) and never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_script_in_a_payload_does_not_run_on_the_message_page() -> anyhow::Result<()> {
    let broker: Arc<dyn Broker> = Arc::new(reliq_memory::MemoryBroker::new());
    let (name, source) = (unique("csp"), unique("csp-src"));
    let (handle, _effects) = consumer_failing(broker.clone(), &name, &source, true).await?;
    let hostile = r#"</textarea></pre><script>document.title='ran';window.ran=1</script><img src=x onerror="window.ran=2">"#;
    let parked = Message::new(hostile);
    let id = parked.id().clone();
    broker
        .publish(&Destination::new(source.clone()), parked)
        .await?;
    wait_for(
        "the hostile payload parked",
        Duration::from_secs(30),
        || handle.stats().dead_lettered == 1,
    )
    .await?;
    let served = serve(
        broker.clone(),
        vec![Subscription::new(name.clone(), source.clone())],
    )
    .await?;
    let shots = Shots::new("memory")?;
    let driver = driver().await?;
    let c = browser(&driver, &served.dir.path().join("profile")).await?;
    let base = served.base.clone();
    let result = async {
        sign_in(&c, &base, &served.operator).await?;
        c.goto(&format!("{base}/console/consumers/{name}/entries/{id}"))
            .await?;
        // The payload, as text, in the payload box and in the edit form.
        let shown = el(&c, Locator::Css("[data-testid=payload]"))
            .await?
            .text()
            .await?;
        ensure!(shown.contains("<script>"), "the payload shown: {shown}");
        let edit = el(&c, Locator::Css("#payload"))
            .await?
            .prop("value")
            .await?;
        ensure!(
            edit.as_deref() == Some(hostile),
            "the edit form holds {edit:?}"
        );
        // Give an image's error handler its chance, then: nothing ran.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ran = c
            .execute("return [document.title, window.ran === undefined];", vec![])
            .await?;
        ensure!(
            ran[1] == serde_json::json!(true) && ran[0] != serde_json::json!("ran"),
            "the payload's script ran: {ran}"
        );
        // The policy itself: an inline script added to the page is refused and never runs.
        let refused = c
            .execute_async(
                r#"const done = arguments[arguments.length - 1];
                   const seen = [];
                   document.addEventListener('securitypolicyviolation',
                       e => seen.push(e.violatedDirective));
                   const s = document.createElement('script');
                   s.textContent = 'window.inline = 1';
                   document.body.appendChild(s);
                   setTimeout(() => done([window.inline === undefined, seen]), 300);"#,
                vec![],
            )
            .await?;
        ensure!(
            refused[0] == serde_json::json!(true),
            "an inline script ran under the policy: {refused}"
        );
        let directives = refused[1].as_array().context("the violations")?;
        ensure!(
            directives
                .iter()
                .any(|d| d.as_str().is_some_and(|d| d.starts_with("script-src"))),
            "no script-src violation reported: {refused}"
        );
        shots.take(&c, "hostile-payload").await?;
        Ok(())
    }
    .await;
    wind_up(&result, &shots, c, handle, "hostile-payload-failure").await;
    result
}

/// From a group list, open the first group's triage and save `status` (and an assignee
/// and a note, when given) through its form.
async fn triage_by_form(
    c: &Client,
    status: &str,
    assignee: Option<&str>,
    note: Option<&str>,
) -> anyhow::Result<()> {
    el(c, Locator::LinkText("Triage")).await?.click().await?;
    el(c, Locator::Css("select#status"))
        .await?
        .select_by_value(status)
        .await?;
    for (field, text) in [("#assignee", assignee), ("#note", note)] {
        if let Some(text) = text {
            el(c, Locator::Css(field)).await?.send_keys(text).await?;
        }
    }
    el(c, Locator::XPath("//button[normalize-space()='Save']"))
        .await?
        .click()
        .await?;
    Ok(())
}

/// The triage page's status once the page a Save posted has loaded (the old page's
/// element goes stale under the poll): `expected`, or what it showed for 10 s.
async fn status_after_save(c: &Client, expected: &str) -> anyhow::Result<String> {
    let mut shown = String::new();
    for _ in 0..40 {
        if let Ok(e) = c.find(Locator::Css("dd[data-testid=status]")).await
            && let Ok(text) = e.text().await
        {
            shown = text;
            if shown == expected {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(shown)
}

/// Triage in the console: an operator opens a group's triage from its row, sets it
/// "investigating" for alice with a note, and sees it on the page and in the row; archived,
/// the group leaves the list (a line says one is hidden, and a link shows it); a reader
/// sees the triage and no form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_triages_a_group_in_the_console() -> anyhow::Result<()> {
    let broker: Arc<dyn Broker> = Arc::new(reliq_memory::MemoryBroker::new());
    let (name, source) = (unique("triage"), unique("triage-src"));
    let (handle, _effects) = consumer_failing(broker.clone(), &name, &source, true).await?;
    park(&broker, &handle, &source, 3, Duration::from_secs(60)).await?;
    let served = serve(
        broker.clone(),
        vec![Subscription::new(name.clone(), source.clone())],
    )
    .await?;
    let shots = Shots::new("memory")?;
    let driver = driver().await?;
    let c = browser(&driver, &served.dir.path().join("profile")).await?;
    let base = served.base.clone();
    let status_in_row = async || -> anyhow::Result<String> {
        Ok(el(
            &c,
            Locator::Css("tr[data-fingerprint] [data-testid=status]"),
        )
        .await?
        .text()
        .await?)
    };
    let result = async {
        sign_in(&c, &base, &served.operator).await?;
        c.goto(&format!("{base}/console/consumers/{name}")).await?;
        ensure!(status_in_row().await? == "new", "a fresh group's status");
        triage_by_form(
            &c,
            "investigating",
            Some("alice"),
            Some("<b>not bold</b>: the 12:03 deploy"),
        )
        .await?;
        // The redirect back: the change shown, the note as text.
        let shown = status_after_save(&c, "investigating").await?;
        ensure!(shown == "investigating", "status after Save: {shown}");
        let assignee = el(&c, Locator::Css("dd[data-testid=assignee]"))
            .await?
            .text()
            .await?;
        let notes = el(&c, Locator::Css("[data-testid=notes]"))
            .await?
            .text()
            .await?;
        ensure!(
            assignee == "alice"
                && notes.contains("<b>not bold</b>: the 12:03 deploy")
                && notes.contains("oscar"),
            "assignee {assignee}, notes {notes}"
        );
        shots.take(&c, "triage").await?;
        c.goto(&format!("{base}/console/consumers/{name}")).await?;
        let row = el(&c, Locator::Css("tr[data-fingerprint] td.triage"))
            .await?
            .text()
            .await?;
        ensure!(
            row.contains("investigating") && row.contains("alice"),
            "the row: {row}"
        );

        // Archived: out of the list, one line says so, its link shows it.
        triage_by_form(&c, "archived", None, None).await?;
        let shown = status_after_save(&c, "archived").await?;
        ensure!(shown == "archived", "status after Save: {shown}");
        c.goto(&format!("{base}/console/consumers/{name}")).await?;
        let page = c.source().await?;
        ensure!(
            !page.contains("data-fingerprint") && page.contains("1 archived group(s) not shown"),
            "the archived group is still listed"
        );
        el(&c, Locator::LinkText("Show them"))
            .await?
            .click()
            .await?;
        ensure!(status_in_row().await? == "archived", "shown on asking");
        sign_out(&c).await?;

        // A reader sees the triage, not the form.
        sign_in(&c, &base, &served.reader).await?;
        c.goto(&format!("{base}/console/consumers/{name}?archived=true"))
            .await?;
        el(&c, Locator::LinkText("Triage")).await?.click().await?;
        el(&c, Locator::Css("dd[data-testid=status]")).await?;
        ensure!(
            c.find_all(Locator::Css("select#status")).await?.is_empty(),
            "a reader sees the triage form"
        );
        Ok(())
    }
    .await;
    wind_up(&result, &shots, c, handle, "triage-failure").await;
    result
}

/// The OpenID provider of `scripts/oidc/provider.mjs` (installed by `scripts/brokers oidc`)
/// on a free port, killed on drop.
struct Provider {
    child: Child,
    issuer: String,
}

impl Drop for Provider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start the provider for a console at `base`, its issuer on `localhost` — another site
/// than the console's 127.0.0.1, as a real provider is (the cookies' SameSite rules
/// apply as they would).
async fn provider(base: &str, secret: &str, log: &std::path::Path) -> anyhow::Result<Provider> {
    let dir = match std::env::var_os("RELIQ_OIDC_PROVIDER_DIR") {
        Some(dir) => std::path::PathBuf::from(dir),
        None => std::env::var_os("BROKERS_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.brokers")
            })
            .join("oidc"),
    };
    ensure!(
        dir.join("node_modules/oidc-provider").is_dir(),
        "no OpenID provider in {}: run scripts/brokers oidc",
        dir.display()
    );
    let port = free_port()?;
    let issuer = format!("http://localhost:{port}");
    let child = std::process::Command::new("node")
        .arg(dir.join("provider.mjs"))
        .env("OIDC_PORT", port.to_string())
        .env("OIDC_ISSUER", &issuer)
        .env("OIDC_CLIENT_SECRET", secret)
        .env(
            "OIDC_REDIRECT_URI",
            format!("{base}{}", reliq_admin::CALLBACK_PATH),
        )
        .env(
            "OIDC_POST_LOGOUT_URI",
            format!("{base}{}", reliq_admin::SIGNED_OUT_PATH),
        )
        .stdout(std::fs::File::create(log)?)
        .stderr(std::fs::File::create(log.with_extension("err"))?)
        .spawn()
        .context("starting node (scripts/brokers oidc installs it)")?;
    let provider = Provider { child, issuer };
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let discovery = format!("http://127.0.0.1:{port}/.well-known/openid-configuration");
    for _ in 0..200 {
        if let Ok(r) = http.get(&discovery).send().await
            && r.status().is_success()
        {
            return Ok(provider);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!(
        "the OpenID provider did not answer on {port}: {}",
        std::fs::read_to_string(log.with_extension("err")).unwrap_or_default()
    )
}

/// Sign in through the provider as `user` (any password), from the console's sign-in
/// page to the overview.
async fn sign_in_at_provider(c: &Client, base: &str, user: &str) -> anyhow::Result<()> {
    c.goto(&format!("{base}/console/sign-in")).await?;
    el(c, Locator::Id("sso")).await?.click().await?;
    el(c, Locator::Css("input[name=login]"))
        .await?
        .send_keys(user)
        .await?;
    el(c, Locator::Css("input[name=password]"))
        .await?
        .send_keys("any password")
        .await?;
    el(c, Locator::Css("button.login-submit"))
        .await?
        .click()
        .await?;
    // The consent page, then back to the console.
    el(c, Locator::XPath("//button[normalize-space()='Continue']"))
        .await?
        .click()
        .await?;
    Ok(())
}

/// Sign out of the console, and at the provider (its confirmation page), back to the
/// console's sign-in page.
async fn sign_out_everywhere(c: &Client, base: &str) -> anyhow::Result<()> {
    el(c, Locator::XPath("//button[normalize-space()='Sign out']"))
        .await?
        .click()
        .await?;
    el(c, Locator::Css("button[name=logout]"))
        .await?
        .click()
        .await?;
    el(c, Locator::Id("token")).await?;
    ensure!(
        c.current_url().await?.as_str() == format!("{base}/console/sign-in"),
        "after the provider's sign-out: {}",
        c.current_url().await?
    );
    Ok(())
}

/// The text of the header's "who" (name and role).
async fn signed_in_as(c: &Client) -> anyhow::Result<String> {
    Ok(el(c, Locator::Css("header span")).await?.text().await?)
}

/// A browser test's end, pass or fail: a screenshot named `failure_shot` when it
/// failed, then the browser closed and the consumer stopped.
async fn wind_up(
    result: &anyhow::Result<()>,
    shots: &Shots,
    c: Client,
    consumer: reliq_core::ConsumerHandle,
    failure_shot: &str,
) {
    if result.is_err() {
        let _ = shots.take(&c, failure_shot).await;
    }
    let _ = c.close().await;
    consumer.shutdown().await;
}

/// Purges a failure group from the consumer's page: preview, confirm the count, and
/// wait for the job; its final state.
async fn purge_group(
    c: &Client,
    base: &str,
    consumer: &str,
    group: &str,
    count: u64,
) -> anyhow::Result<String> {
    c.goto(&format!("{base}/console/consumers/{consumer}"))
        .await?;
    click_in_row(c, group, "Preview purge").await?;
    el(
        c,
        Locator::XPath(&format!(
            "//button[starts-with(normalize-space(), 'Purge these {count}')]"
        )),
    )
    .await?
    .click()
    .await?;
    wait_for_job(c).await
}

/// Single sign-on through a real OpenID provider (npm's `oidc-provider`) in Chromium:
/// the authorization code flow with PKCE from the sign-in page's button; the `roles`
/// claim mapped (a reader finds no action, an operator replays, an admin purges, a user
/// with no mapped role is refused with 403); sign-out ends the session here and at the
/// provider (the next sign-in asks for the password again); a session whose access token
/// expires at the provider is signed out with a notice; a callback this browser did not
/// start is refused; every sign-in is audited under the provider's name for the user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_sign_in_through_an_openid_provider() -> anyhow::Result<()> {
    let broker: Arc<dyn Broker> = Arc::new(reliq_memory::MemoryBroker::new());
    let (name, source) = (unique("sso"), unique("sso-src"));
    let (handle, effects) = consumer_failing(broker.clone(), &name, &source, true).await?;
    park(&broker, &handle, &source, 3, Duration::from_secs(60)).await?;
    let sub = Subscription::new(name.clone(), source.clone());
    let depth = async || -> anyhow::Result<u64> {
        Ok(broker.dead_letters(&sub).await?.count().await?.count)
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let logs = tempfile::tempdir()?;
    let secret = format!("secret-{}", unique("oidc"));
    let idp = provider(&base, &secret, &logs.path().join("provider.log")).await?;
    let audit_path = logs.path().join("audit.jsonl");
    let settings = reliq_admin::OidcSettings {
        client_secret: Some(secret.clone()),
        ..reliq_admin::OidcSettings::new(
            &idp.issuer,
            "reliq-console",
            &format!("{base}{}", reliq_admin::CALLBACK_PATH),
        )
    };
    let served = serve_on(
        listener,
        broker.clone(),
        vec![sub.clone()],
        AuditLog::to_file(&audit_path)?,
        |state| Ok(state.with_oidc(reliq_admin::Oidc::new(settings)?)),
    )
    .await?;
    let shots = Shots::new("oidc")?;
    let driver = driver().await?;
    let c = browser(&driver, &served.dir.path().join("profile")).await?;
    let group = "undecodable field at byte <n>";
    let result = async {
        // A callback this browser did not start: refused, nothing signed in.
        c.goto(&format!(
            "{base}/console/oidc/callback?code=stolen&state=forged"
        ))
        .await?;
        let page = c.source().await?;
        ensure!(
            page.contains("400") && page.contains("not started in this browser"),
            "a forged callback: {page}"
        );

        // A reader: signed in through the provider, sees the group and no action.
        sign_in_at_provider(&c, &base, "rita").await?;
        el(&c, Locator::Css("nav")).await?;
        let who = signed_in_as(&c).await?;
        ensure!(who.contains("oidc:rita") && who.contains("reader"), "{who}");
        c.goto(&format!("{base}/console/consumers/{name}")).await?;
        el(&c, Locator::XPath(&format!("//tr[contains(., '{group}')]"))).await?;
        let mut buttons = Vec::new();
        for b in c.find_all(Locator::Css("main button")).await? {
            buttons.push(b.text().await?);
        }
        ensure!(buttons.is_empty(), "a reader sees buttons: {buttons:?}");
        shots.take(&c, "reader").await?;
        sign_out_everywhere(&c, &base).await?;
        c.goto(&format!("{base}/console/")).await?;
        ensure!(
            c.current_url().await?.path() == "/console/sign-in",
            "signed out, still in"
        );
        // Signed out at the provider too: its sign-in asks for a password again.
        el(&c, Locator::Id("sso")).await?.click().await?;
        el(&c, Locator::Css("input[name=password]")).await?;
        shots.take(&c, "provider-login").await?;

        // An operator replays the group: every dead letter handled once.
        sign_in_at_provider(&c, &base, "oscar").await?;
        el(&c, Locator::Css("nav")).await?;
        ensure!(signed_in_as(&c).await?.contains("operator"), "oscar's role");
        c.goto(&format!("{base}/console/consumers/{name}")).await?;
        click_in_row(&c, group, "Replay").await?;
        let state = wait_for_job(&c).await?;
        ensure!(state == "succeeded", "oscar's replay ended {state}");
        wait_for(
            "the 3 replayed copies handled",
            Duration::from_secs(30),
            || effects.count() == 3,
        )
        .await?;
        sign_out_everywhere(&c, &base).await?;

        // An admin purges.
        park(&broker, &handle, &source, 1, Duration::from_secs(60)).await?;
        sign_in_at_provider(&c, &base, "ada").await?;
        el(&c, Locator::Css("nav")).await?;
        ensure!(signed_in_as(&c).await?.contains("admin"), "ada's role");
        let state = purge_group(&c, &base, &name, group, 1).await?;
        ensure!(
            state == "succeeded" && depth().await? == 0,
            "ada's purge ended {state}"
        );
        sign_out_everywhere(&c, &base).await?;

        // A reader whose access token lasts 4 s: in, then out with a notice once it expired.
        sign_in_at_provider(&c, &base, "tess").await?;
        el(&c, Locator::Css("nav")).await?;
        let signed_in = std::time::Instant::now();
        ensure!(signed_in_as(&c).await?.contains("oidc:tess"), "tess");
        tokio::time::sleep(Duration::from_secs(5).saturating_sub(signed_in.elapsed())).await;
        c.goto(&format!("{base}/console/consumers/{name}")).await?;
        let notice = el(&c, Locator::Css("p.error")).await?.text().await?;
        ensure!(
            c.current_url().await?.path() == "/console/sign-in" && notice.contains("expired"),
            "after the provider's token expired: {} {notice:?}",
            c.current_url().await?
        );
        shots.take(&c, "expired").await?;
        // tess is still signed in at the provider: sign out there before the next user.
        c.goto(&format!("{}/session/end", idp.issuer)).await?;
        el(&c, Locator::Css("button[name=logout]"))
            .await?
            .click()
            .await?;
        el(&c, Locator::XPath("//h1[contains(., 'Sign-out')]")).await?;

        // A user with no reliq role: refused with 403, naming the claim's values.
        sign_in_at_provider(&c, &base, "nora").await?;
        let refusal = el(&c, Locator::Css("p.error")).await?.text().await?;
        ensure!(
            refusal.contains("oidc:nora") || refusal.contains("`nora`"),
            "{refusal}"
        );
        ensure!(refusal.contains("staff"), "{refusal}");
        let page = c.source().await?;
        ensure!(page.contains("403"), "nora's page: {page}");
        c.goto(&format!("{base}/console/")).await?;
        ensure!(
            c.current_url().await?.path() == "/console/sign-in",
            "a user without a role got in"
        );

        // The audit log: each sign-in under the provider's name, and nora's refusal.
        let audit = std::fs::read_to_string(&audit_path)?;
        let records: Vec<serde_json::Value> = audit
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        let callbacks: Vec<(String, u64)> = records
            .iter()
            .filter(|r| r["action"] == "console-oidc-callback")
            .map(|r| {
                (
                    r["actor"].as_str().unwrap_or("-").to_owned(),
                    r["status"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        let expected: Vec<(String, u64)> = [
            ("-", 400),
            ("oidc:rita", 200),
            ("oidc:oscar", 200),
            ("oidc:ada", 200),
            ("oidc:tess", 200),
            ("-", 403),
        ]
        .into_iter()
        .map(|(a, s)| (a.to_owned(), s))
        .collect();
        ensure!(
            callbacks == expected,
            "the audited callbacks: {callbacks:?}"
        );
        ensure!(
            !audit.contains(&secret) && !audit.contains("stolen"),
            "the audit log holds a secret or a code"
        );
        Ok(())
    }
    .await;
    wind_up(&result, &shots, c, handle, "failure").await;
    drop(idp);
    result
}

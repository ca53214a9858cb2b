//! The console's pages, as maud markup: plain HTML forms (no script), labelled controls,
//! one stylesheet served from the binary.

use maud::{DOCTYPE, Markup, PreEscaped, html};

use crate::auth::{Principal, Role};
use crate::jobs::{JobState, JobView};
use crate::ops::{DlqStats, EntryDetail, EntryList, RunOutcome, SchemaView};

/// The console's stylesheet (served at `/console/assets/console.css`).
pub const STYLESHEET: &str = r#"
:root { font-family: system-ui, sans-serif; line-height: 1.4; color: #1b1b1b; background: #fafafa; }
body { margin: 0; }
header { display: flex; flex-wrap: wrap; gap: .5rem 1.5rem; align-items: center; padding: .6rem 1rem; background: #20303f; color: #fff; }
header a, header button { color: #fff; }
header form { margin: 0; margin-left: auto; }
nav { display: flex; flex-wrap: wrap; gap: 1rem; }
main { padding: 1rem; max-width: 80rem; margin: 0 auto; }
h1 { font-size: 1.4rem; margin: .2rem 0 1rem; }
h2 { font-size: 1.1rem; margin-top: 1.5rem; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; background: #fff; }
th, td { text-align: left; padding: .35rem .6rem; border-bottom: 1px solid #ddd; vertical-align: top; }
th { background: #eef1f4; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, monospace; font-size: .9rem; }
pre { background: #fff; border: 1px solid #ddd; padding: .6rem; overflow-x: auto; white-space: pre-wrap; word-break: break-all; }
form.inline { display: inline-flex; flex-wrap: wrap; gap: .3rem; align-items: center; margin: .15rem 0; }
fieldset { border: 1px solid #ccc; background: #fff; margin: 1rem 0; }
label { display: inline-block; margin-right: .3rem; }
input, select, textarea, button { font: inherit; }
input[type=number] { width: 6rem; }
textarea { width: 100%; min-height: 10rem; }
button { cursor: pointer; padding: .2rem .7rem; border: 1px solid #20303f; background: #fff; border-radius: 3px; }
button.danger { border-color: #a11; color: #a11; }
a.button { display: inline-block; padding: .3rem .8rem; border-radius: 3px; background: #20303f; color: #fff; text-decoration: none; }
header button { background: transparent; border-color: #fff; color: #fff; }
td a + form, td form + form { margin-left: .3rem; }
td > a { margin-right: .5rem; }
:focus-visible { outline: 3px solid #f0a000; outline-offset: 2px; }
.notice { padding: .6rem; background: #fff7d6; border: 1px solid #e0c060; }
.error { padding: .6rem; background: #fde8e8; border: 1px solid #d08080; }
.muted { color: #666; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .2rem 1rem; background: #fff; padding: .6rem; border: 1px solid #ddd; }
dt { font-weight: 600; }
dd { margin: 0; word-break: break-all; }
th[scope=row] { background: transparent; }
ul.tiers { list-style: none; margin: .2rem 0 0; padding: 0; font-size: .85rem; color: #555; }
a.skip { position: absolute; left: -999px; top: .3rem; background: #fff; color: #20303f; padding: .3rem .6rem; z-index: 1; }
a.skip:focus { left: .5rem; }
@media (max-width: 40rem) {
  main { padding: .5rem; }
  header form { margin-left: 0; }
  dl { grid-template-columns: 1fr; }
  dt { margin-top: .4rem; }
  th, td { padding: .3rem .4rem; }
}
"#;

/// A page's `<head>`: its title, the viewport, the stylesheet.
pub fn head(title: &str) -> Markup {
    html! {
        head {
            meta charset="utf-8";
            meta name="viewport" content="width=device-width, initial-scale=1";
            title { (title) " · reliq" }
            link rel="stylesheet" href="/console/assets/console.css";
        }
    }
}

/// A page for a signed-in user: the header (navigation, who, sign-out) and `body`.
pub fn layout(title: &str, who: &Principal, csrf: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head(title))
            body {
                a.skip href="#main" { "Skip to content" }
                header {
                    strong { "reliq" }
                    nav aria-label="Console" {
                        a href="/console/" { "Overview" }
                        a href="/console/jobs" { "Jobs" }
                        @if who.role >= Role::Admin { a href="/console/audit" { "Audit log" } }
                    }
                    form method="post" action="/console/sign-out" {
                        input type="hidden" name="csrf" value=(csrf);
                        span { (who.name) " (" (who.role.as_str()) ") " }
                        button type="submit" { "Sign out" }
                    }
                }
                main #main tabindex="-1" { h1 { (title) } (body) }
            }
        }
    }
}

/// The sign-in page.
pub fn sign_in(error: Option<&str>, single_sign_on: bool) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            (head("Sign in"))
            body {
                main {
                    h1 { "reliq console" }
                    @if let Some(e) = error { p.error role="alert" { (e) } }
                    @if single_sign_on {
                        p { a.button #sso href="/console/oidc/start" { "Sign in with single sign-on" } }
                        p.muted { "Or with an admin token:" }
                    }
                    form method="post" action="/console/sign-in" {
                        p {
                            label for="token" { "Admin token" }
                            input #token type="password" name="token" autocomplete="off" required autofocus;
                        }
                        button type="submit" { "Sign in" }
                    }
                    p.muted { "A token from " code { "reliq admin token" } "; its role decides what this console lets you do." }
                }
            }
        }
    }
}

/// After a sign-in at the identity provider: on to the overview (a same-site move, so
/// the new `SameSite=Strict` session cookie goes with it; no script: a meta refresh).
pub fn signed_in(name: &str) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta http-equiv="refresh" content="0; url=/console/";
                title { "Signed in — reliq" }
                link rel="stylesheet" href="/console/assets/console.css";
            }
            body {
                main {
                    h1 { "Signed in" }
                    p { "Signed in as " strong { (name) } ". " a href="/console/" { "On to the console" } "." }
                }
            }
        }
    }
}

/// One overview row.
#[derive(Debug)]
pub struct OverviewRow {
    pub consumer: String,
    pub source: String,
    pub count: Option<u64>,
    pub oldest_age_seconds: Option<u64>,
    pub last_hour: Option<u64>,
    pub error: Option<String>,
    /// What waits at the broker, or why it could not be read.
    pub backlog: Result<reliq_core::Backlog, String>,
}

fn age(seconds: u64) -> String {
    humantime::format_duration(std::time::Duration::from_secs(seconds)).to_string()
}

fn known(n: Option<u64>) -> String {
    n.map_or_else(|| "—".to_owned(), |n| n.to_string())
}

/// The retries column: the total, and each tier's where the broker keeps tiers apart.
fn retries(backlog: &reliq_core::Backlog) -> Markup {
    html! {
        (known(backlog.retries))
        @if !backlog.retry_tiers.is_empty() {
            ul.tiers {
                @for t in &backlog.retry_tiers {
                    li { (humantime::format_duration(t.delay)) ": " (t.waiting) }
                }
            }
        }
    }
}

/// Every consumer the server knows, with its DLQ and what waits for it at the broker.
pub fn overview(rows: &[OverviewRow]) -> Markup {
    html! {
        @if rows.is_empty() {
            p.notice { "No consumers configured: start the server with " code { "--consumer name=source[@tier,tier…]" } " (repeatable)." }
        } @else {
            div.scroll { table #overview {
                caption.muted { "Consumers: their dead-letter queues, and what waits for them at the broker (— where the broker does not say)" }
                thead { tr {
                    th scope="col" { "Consumer" } th scope="col" { "Source" }
                    th.num scope="col" { "Dead letters" } th scope="col" { "Oldest" } th.num scope="col" { "Last hour" }
                    th.num scope="col" { "Waiting" } th.num scope="col" { "In flight" } th.num scope="col" { "Retries waiting" }
                } }
                tbody {
                    @for r in rows {
                        tr data-consumer=(r.consumer) {
                            th scope="row" { a href={ "/console/consumers/" (r.consumer) } { (r.consumer) } }
                            td { code { (r.source) } }
                            @if let Some(e) = &r.error {
                                td colspan="3" { span.error { (e) } }
                            } @else {
                                td.num.dead { (r.count.unwrap_or(0)) }
                                td { (r.oldest_age_seconds.map(age).unwrap_or_else(|| "—".into())) }
                                td.num { (r.last_hour.unwrap_or(0)) }
                            }
                            @match &r.backlog {
                                Ok(b) => {
                                    td.num.waiting { (b.waiting) }
                                    td.num.in-flight { (known(b.in_flight)) }
                                    td.num.retries { (retries(b)) }
                                }
                                Err(e) => { td colspan="3" { span.error { (e) } } }
                            }
                        }
                    }
                }
            } }
            p.muted { "Their channels — source, retries, dead letters — as an AsyncAPI 3.0 document: " a href="/console/asyncapi.json" download="asyncapi.json" { "asyncapi.json" } }
        }
    }
}

/// The hidden fields every changing form carries: the CSRF token and the filter.
fn hidden(csrf: &str, fields: &[(&str, &str)]) -> Markup {
    html! {
        input type="hidden" name="csrf" value=(csrf);
        @for (k, v) in fields { input type="hidden" name=(k) value=(v); }
    }
}

/// Replay (dry run / at a rate) and purge forms for the entries `fields` select.
fn actions(
    consumer: &str,
    who: &Principal,
    csrf: &str,
    fields: &[(&str, &str)],
    label: &str,
) -> Markup {
    html! {
        @if who.role >= Role::Operator {
            form.inline method="post" action={ "/console/consumers/" (consumer) "/replay" } {
                (hidden(csrf, fields))
                input type="hidden" name="dry_run" value="true";
                button type="submit" { "Preview replay" span.muted { " " (label) } }
            }
            form.inline method="post" action={ "/console/consumers/" (consumer) "/replay" } {
                (hidden(csrf, fields))
                label { "at " input type="number" name="rate" value="100" min="0" aria-label="messages per second"; " /s" }
                button type="submit" { "Replay" span.muted { " " (label) } }
            }
        }
        @if who.role >= Role::Admin {
            form.inline method="post" action={ "/console/consumers/" (consumer) "/purge" } {
                (hidden(csrf, fields))
                input type="hidden" name="dry_run" value="true";
                button.danger type="submit" { "Preview purge" span.muted { " " (label) } }
            }
        }
    }
}

/// A consumer's failure groups, most recent first, with their actions.
pub fn groups(
    consumer: &str,
    stats: &DlqStats,
    who: &Principal,
    csrf: &str,
    triage: bool,
) -> Markup {
    let mut groups: Vec<_> = stats.groups.iter().collect();
    groups.sort_by(|a, b| b.last_seen.cmp(&a.last_seen));
    html! {
        p {
            strong { (stats.count) } " dead letters"
            @if let Some(a) = stats.oldest_age_seconds { ", the oldest " (age(a)) " old" }
            @if stats.unreadable > 0 { "; " (stats.unreadable) " without a readable record" }
            ". " a href={ "/console/consumers/" (consumer) "/entries" } { "List and search" }
        }
        @if stats.archived_groups > 0 {
            p.muted {
                (stats.archived_groups) " archived group(s) not shown. "
                a href={ "/console/consumers/" (consumer) "?archived=true" } { "Show them" }
            }
        }
        @if groups.is_empty() {
            p.notice { "The DLQ is empty." }
        } @else {
            div.scroll { table {
                caption.muted { "Failure groups (reason, class and error fingerprint), most recent first" }
                thead { tr {
                    th.num { "Count" } th { "Reason / class" } th { "Error" }
                    @if triage { th { "Triage" } }
                    th { "First seen" } th { "Last seen" } th { "Actions" }
                } }
                tbody {
                    @for g in groups {
                        tr data-fingerprint=(g.fingerprint.id) {
                            td.num { (g.count) }
                            td { (g.fingerprint.reason) @if let Some(c) = &g.fingerprint.class { " / " (c) } }
                            td { code { (g.fingerprint.masked_error) } br; span.muted { "fingerprint " code { (g.fingerprint.id) } } }
                            @if triage {
                                td.triage {
                                    span data-testid="status" { (g.status.as_str()) }
                                    @if let Some(a) = &g.assignee { br; span.muted { (a) } }
                                    br;
                                    a href={ "/console/consumers/" (consumer) "/groups/" (g.fingerprint.id) } { "Triage" }
                                }
                            }
                            td { (g.first_seen) }
                            td { (g.last_seen) }
                            td {
                                a href={ "/console/consumers/" (consumer) "/entries?fingerprint=" (g.fingerprint.id) } { "Entries" }
                                (actions(consumer, who, csrf, &[("fingerprint", g.fingerprint.id.as_str())], "this group"))
                            }
                        }
                    }
                }
            } }
        }
    }
}

/// A group's triage: where it stands, who has it, the notes; the form for an operator.
pub fn triage(t: &crate::triage::Triage, who: &Principal, csrf: &str) -> Markup {
    use crate::triage::{MAX_ASSIGNEE, MAX_NOTE, TriageStatus};
    html! {
        dl {
            dt { "Status" } dd data-testid="status" { (t.status.as_str()) }
            dt { "Assignee" } dd data-testid="assignee" { (t.assignee.as_deref().unwrap_or("—")) }
            dt { "Last change" } dd {
                @match (&t.updated_at, &t.updated_by) {
                    (Some(at), Some(by)) => { (at) " by " (by) }
                    _ => { "never triaged" }
                }
            }
        }
        p {
            a href={ "/console/consumers/" (t.consumer) "/entries?fingerprint=" (t.fingerprint) } { "Its entries" }
            " · "
            a href={ "/console/consumers/" (t.consumer) } { "All groups" }
        }
        h2 { "Notes" }
        @if t.notes.is_empty() {
            p.muted { "No notes yet." }
        } @else {
            ol data-testid="notes" {
                @for n in &t.notes {
                    li { span.muted { (n.at) " · " (n.author) } br; (n.text) }
                }
            }
        }
        @if who.role >= Role::Operator {
            form method="post" action={ "/console/consumers/" (t.consumer) "/groups/" (t.fingerprint) } {
                fieldset {
                    legend { "Triage this group" }
                    (hidden(csrf, &[]))
                    p {
                        label for="status" { "Status" }
                        select #status name="status" {
                            @for s in TriageStatus::ALL {
                                option value=(s.as_str()) selected[s == t.status] { (s.as_str()) }
                            }
                        }
                    }
                    p {
                        label for="assignee" { "Assignee (empty: nobody)" }
                        input #assignee type="text" name="assignee" maxlength=(MAX_ASSIGNEE)
                            value=(t.assignee.as_deref().unwrap_or(""));
                    }
                    p {
                        label for="note" { "Add a note" }
                        textarea #note name="note" rows="3" maxlength=(MAX_NOTE) {}
                    }
                    button type="submit" { "Save" }
                }
            }
        }
    }
}

/// The list-and-search page: the filter form, a page of entries, the next page's link.
pub fn entries(consumer: &str, query: &[(String, String)], page: &EntryList) -> Markup {
    let value = |name: &str| {
        query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let mut next: Vec<(String, String)> = query
        .iter()
        .filter(|(k, _)| k != "cursor")
        .cloned()
        .collect();
    next.push(("cursor".into(), page.next_cursor.clone()));
    let next_query = serde_urlencoded::to_string(&next).unwrap_or_default();
    html! {
        form method="get" action={ "/console/consumers/" (consumer) "/entries" } {
            fieldset {
                legend { "Filter" }
                @for (name, label) in [("reason", "Reason"), ("class", "Class"), ("fingerprint", "Fingerprint"), ("id", "Message id"),
                    ("header", "Header k=v"), ("payload_contains", "Payload contains"), ("since", "Since (RFC 3339 or 2h)"), ("until", "Until")] {
                    label { (label) " " input type="text" name=(name) value=(value(name)); }
                }
                button type="submit" { "Search" }
            }
        }
        div.scroll { table {
            caption.muted { (page.entries.len()) " entries (" (page.scanned) " read)" }
            thead { tr { th { "Id" } th { "Reason" } th.num { "Attempts" } th { "Dead-lettered at" } th { "Error" } th { "Position" } } }
            tbody {
                @for e in &page.entries {
                    tr {
                        td { a href={ "/console/consumers/" (consumer) "/entries/" (e.id) } { code { (e.id) } } }
                        td { (e.reason) @if let Some(c) = &e.class { " / " (c) } }
                        td.num { (e.attempts) }
                        td { (e.dead_lettered_at) }
                        td { (e.error.as_deref().unwrap_or("")) }
                        td.muted { (e.position) }
                    }
                }
            }
        } }
        @if !page.at_end {
            p { a href={ "/console/consumers/" (consumer) "/entries?" (next_query) } rel="next" { "Next page" } }
        } @else {
            p.muted { "End of the DLQ." }
        }
    }
}

/// One entry: its record, headers, payload; replay it, or edit and replay it.
pub fn detail(consumer: &str, d: &EntryDetail, who: &Principal, csrf: &str) -> Markup {
    let s = &d.summary;
    let payload = match (&d.payload, d.payload_encoding) {
        (serde_json::Value::String(text), "text" | "hex") => text.clone(),
        (value, _) => serde_json::to_string_pretty(value).unwrap_or_default(),
    };
    // A registry-framed payload decoded with its writer's schema: shown, and what the
    // edit form starts from (written back with the same schema).
    let decoded = match &d.schema {
        Some(SchemaView::Decoded(r)) => r
            .value
            .as_ref()
            .map(|v| (r, serde_json::to_string_pretty(v).unwrap_or_default())),
        _ => None,
    };
    let editable = decoded
        .as_ref()
        .map_or_else(|| payload.clone(), |(_, text)| text.clone());
    let header = |name: &str| d.headers.get(name).cloned().unwrap_or_else(|| "—".into());
    let user_headers: Vec<(&String, &String)> = d
        .headers
        .iter()
        .filter(|(k, _)| !k.starts_with(reliq_core::seam::headers::PREFIX))
        .collect();
    html! {
        dl {
            dt { "Reason" } dd { (s.reason) }
            dt { "Class" } dd { (s.class.as_deref().unwrap_or("—")) }
            dt { "Attempts" } dd { (s.attempts) }
            dt { "First failure" } dd { (header(reliq_core::seam::headers::FIRST_FAILURE_AT)) }
            dt { "Last failure" } dd { (header(reliq_core::seam::headers::LAST_FAILURE_AT)) }
            dt { "Dead-lettered at" } dd { (s.dead_lettered_at) }
            dt { "Last error" } dd { code { (s.error.as_deref().unwrap_or("—")) } }
            dt { "Fingerprint" } dd { code { (s.fingerprint) } }
            dt { "Original destination" } dd { code { (header(reliq_core::seam::headers::ORIGINAL_DESTINATION)) } }
            dt { "Original position" } dd { (s.position) }
            dt { "Key" } dd { (s.key.as_deref().unwrap_or("—")) }
        }
        h2 { "Payload (" (d.payload_encoding) ", " (s.payload_bytes) " bytes)" }
        pre data-testid="payload" { (payload) }
        @match &d.schema {
            Some(SchemaView::Decoded(r)) => {
                h2 { "Decoded with schema " (r.schema_id) " (" (format!("{:?}", r.schema_type)) ")" }
                @if let Some((_, text)) = &decoded {
                    pre data-testid="decoded" { (text) }
                }
                @if let Some(note) = &r.note { p.muted { (note) } }
            }
            Some(SchemaView::Unavailable { error }) => {
                p.error { "The schema registry could not decode it: " (error) }
            }
            None => {}
        }
        h2 { "Headers" }
        div.scroll { table {
            thead { tr { th { "Name" } th { "Value" } } }
            tbody { @for (k, v) in &d.headers { tr { td { code { (k) } } td { code { (v) } } } } }
        } }
        @if who.role >= Role::Operator {
            h2 { "Replay" }
            (actions(consumer, who, csrf, &[("id", s.id.as_str())], "this message"))
            form method="post" action={ "/console/consumers/" (consumer) "/entries/" (s.id) "/edit" } {
                fieldset {
                    legend { "Edit and replay (a new message whose causation id is this one's)" }
                    @if decoded.is_some() {
                        (hidden(csrf, &[("encoding", "schema")]))
                        p { label for="payload" { "Value (JSON; written with the same schema)" } textarea #payload name="payload" { (editable) } }
                    } @else {
                        (hidden(csrf, &[]))
                        p { label for="payload" { "Payload" } textarea #payload name="payload" { (editable) } }
                    }
                    p {
                        label for="headers" { "Headers to set, one " code { "name=value" } " per line" }
                        textarea #headers name="headers" rows="3" {
                            @for (k, v) in &user_headers { (k) "=" (v) "\n" }
                        }
                    }
                    button type="submit" { "Replay the edited copy" }
                }
            }
        }
    }
}

/// What a dry run found, and the button that does it for real.
pub fn preview(
    consumer: &str,
    outcome: &RunOutcome,
    fields: &[(String, String)],
    csrf: &str,
) -> Markup {
    let pairs: Vec<(&str, &str)> = fields
        .iter()
        .filter(|(k, _)| k != "csrf" && k != "dry_run")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let verb = if outcome.operation == "replay" {
        "replayed"
    } else {
        "purged"
    };
    html! {
        p.notice role="status" data-testid="preview" {
            strong { (outcome.matched) } " dead letters would be " (verb) " (of " (outcome.scanned) " read). Nothing was changed."
        }
        @if !outcome.ids.is_empty() {
            h2 { "Which" }
            ul { @for id in outcome.ids.iter().take(50) { li { a href={ "/console/consumers/" (consumer) "/entries/" (id) } { code { (id) } } } } }
            @if outcome.ids.len() > 50 { p.muted { "… and " (outcome.ids.len() - 50) " more" } }
            form method="post" action={ "/console/consumers/" (consumer) "/" (outcome.operation) } {
                (hidden(csrf, &pairs))
                @if outcome.operation == "purge" {
                    button.danger type="submit" { "Purge these " (outcome.matched) " for good" }
                } @else {
                    button type="submit" { "Replay these " (outcome.matched) }
                }
            }
        }
    }
}

/// The jobs of this server.
pub fn jobs(jobs: &[JobView]) -> Markup {
    html! {
        @if jobs.is_empty() { p.muted { "No job yet." } } @else {
            div.scroll { table {
                thead { tr { th { "Job" } th { "Operation" } th { "Consumer" } th { "By" } th { "State" } th.num { "Done" } th.num { "Matched" } th { "Started" } } }
                tbody {
                    @for j in jobs {
                        tr {
                            td { a href={ "/console/jobs/" (j.id) } { code { (j.id) } } }
                            td { (j.operation) } td { (j.consumer) } td { (j.actor) }
                            td { (state(j.state)) }
                            td.num { (j.progress.done) } td.num { (j.progress.matched) }
                            td { (j.started_at) }
                        }
                    }
                }
            } }
        }
    }
}

fn state(s: JobState) -> &'static str {
    match s {
        JobState::Running => "running",
        JobState::Succeeded => "succeeded",
        JobState::Incomplete => "incomplete",
        JobState::Cancelled => "cancelled",
        JobState::Failed => "failed",
    }
}

/// One job, refreshing itself every 2 s while it runs.
pub fn job(j: &JobView, who: &Principal, csrf: &str) -> Markup {
    html! {
        @if j.state == JobState::Running { (PreEscaped(r#"<meta http-equiv="refresh" content="2">"#)) }
        dl {
            dt { "State" } dd data-testid="job-state" { (state(j.state)) }
            dt { "Operation" } dd { (j.operation) " on " (j.consumer) }
            dt { "By" } dd { (j.actor) }
            dt { "Read / matched / done / failed" } dd { (j.progress.scanned) " / " (j.progress.matched) " / " (j.progress.done) " / " (j.progress.failed) }
            dt { "Started" } dd { (j.started_at) }
            dt { "Finished" } dd { (j.finished_at.as_deref().unwrap_or("—")) }
            @if let Some(o) = &j.outcome {
                dt { "Rate" } dd { (format!("{:.0}", o.rate_per_second)) "/s over " (format!("{:.1}", o.publishing_seconds)) " s" }
            }
            @if let Some(e) = &j.error { dt { "Error" } dd.error { (e) } }
        }
        @if j.state == JobState::Running && who.role >= Role::Operator {
            form method="post" action={ "/console/jobs/" (j.id) "/cancel" } {
                (hidden(csrf, &[]))
                button.danger type="submit" { "Cancel" }
            }
        }
    }
}

/// The audit log's last records, newest first.
pub fn audit(records: &[serde_json::Value]) -> Markup {
    let field = |r: &serde_json::Value, k: &str| match &r[k] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    };
    html! {
        @if records.is_empty() { p.muted { "Nothing audited yet, or the server runs without --audit-log." } } @else {
            div.scroll { table {
                thead { tr { th { "At" } th { "Who" } th { "Request" } th { "Action" } th { "Consumer" } th { "Outcome" } th.num { "Status" } } }
                tbody {
                    @for r in records {
                        tr {
                            td { (field(r, "at")) } td { (field(r, "actor")) } td { code { (field(r, "request")) } }
                            td { (field(r, "action")) } td { (field(r, "consumer")) } td { (field(r, "outcome")) } td.num { (field(r, "status")) }
                        }
                    }
                }
            } }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::EntrySummary;

    fn entry(schema: Option<SchemaView>) -> EntryDetail {
        EntryDetail {
            summary: EntrySummary {
                id: "m-1".into(),
                position: "offset 7".into(),
                key: None,
                reason: "permanent".into(),
                class: Some("permanent".into()),
                error: Some("over the limit".into()),
                fingerprint: "f1".into(),
                attempts: 1,
                dead_lettered_at: "2026-12-08T01:00:00.000Z".into(),
                payload_bytes: 9,
            },
            headers: Default::default(),
            payload_encoding: "hex",
            payload: serde_json::Value::String("000000002a0a6f2d37".into()),
            schema,
        }
    }

    /// A registry-framed dead letter's page shows its decoded value, and the operator's
    /// edit form starts from that value and asks for it to be written with the schema;
    /// without a decoded value the form edits the payload itself.
    #[test]
    fn a_decoded_dead_letter_is_edited_as_its_value() {
        let operator = Principal {
            name: "oscar".into(),
            role: Role::Operator,
        };
        let decoded = SchemaView::Decoded(reliq_contracts::Readable {
            schema_id: 42,
            schema_type: reliq_contracts::SchemaType::Avro,
            value: Some(serde_json::json!({ "order": "o-7", "cents": 1250 })),
            note: None,
        });
        let page = detail("billing", &entry(Some(decoded)), &operator, "t").into_string();
        assert!(page.contains("Decoded with schema 42 (Avro)"), "{page}");
        assert!(page.contains(r#"name="encoding" value="schema""#), "{page}");
        let form = &page[page
            .find("<textarea id=\"payload\"")
            .expect("the edit form")..];
        assert!(form.contains("&quot;cents&quot;: 1250"), "{form}");
        let plain = detail("billing", &entry(None), &operator, "t").into_string();
        assert!(!plain.contains(r#"name="encoding""#), "{plain}");
        assert!(plain.contains("000000002a0a6f2d37"));
    }
}

//! How a console handler answers: a page, a redirect or a refusal, each carrying its
//! audit note for the audit middleware; and the cookies it reads and sets.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use maud::Markup;

use super::pages;
use crate::error::AdminError;
use crate::sessions::{SESSION_COOKIE, SESSION_TTL};
use crate::state::{AdminState, AuditNote};

/// A page answer: a response carrying its audit note (for the audit middleware).
pub(super) type Page = Response;

pub(super) fn with_note(mut response: Response, status: StatusCode, note: AuditNote) -> Page {
    *response.status_mut() = status;
    response.extensions_mut().insert(note);
    response
}

pub(super) fn page(note: AuditNote, markup: Markup) -> Page {
    with_note(markup.into_response(), StatusCode::OK, note)
}

pub(super) fn redirect(note: AuditNote, to: &str) -> Page {
    with_note(
        Redirect::to(to).into_response(),
        StatusCode::SEE_OTHER,
        note,
    )
}

/// A refusal or failure, as a page with its status.
pub(super) fn refusal(mut note: AuditNote, status: StatusCode, message: String) -> Page {
    note.reason = Some(message.clone());
    let body = maud::html! {
        (maud::DOCTYPE)
        html lang="en" {
            (pages::head(&status.as_u16().to_string()))
            body { main {
                h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
                p.error role="alert" { (message) }
                p { a href="/console/" { "Back to the overview" } }
            } }
        }
    };
    with_note(body.into_response(), status, note)
}

pub(super) fn failed(note: AuditNote, e: AdminError) -> Page {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    refusal(note, status, e.to_string())
}

pub(super) fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// The note of a page anyone may fetch and that changes nothing (the sign-in page, the
/// stylesheet, a sign-in's start): not audited unless refused, so that the audit log
/// cannot be grown without a credential.
pub(super) fn quiet_note(action: &'static str) -> AuditNote {
    AuditNote {
        quiet: true,
        ..note(action, None)
    }
}

pub(super) fn note(action: &'static str, consumer: Option<&str>) -> AuditNote {
    AuditNote {
        action,
        consumer: consumer.map(str::to_owned),
        ..AuditNote::default()
    }
}

/// The session cookie for session `id`.
pub(super) fn session_cookie(state: &AdminState, id: &str) -> String {
    let secure = if state.secure_cookies { "; Secure" } else { "" };
    format!(
        "{SESSION_COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/console; Max-Age={}{secure}",
        SESSION_TTL.as_secs()
    )
}

/// Add a `Set-Cookie` header (beside any other).
pub(super) fn set_cookie(response: &mut Response, cookie: &str) {
    if let Ok(v) = HeaderValue::from_str(cookie) {
        response.headers_mut().append(header::SET_COOKIE, v);
    }
}

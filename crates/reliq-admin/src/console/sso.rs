//! The console's single sign-on pages (the flow itself: [`crate::oidc`]).

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;

use super::pages;
use super::respond::{
    Page, cookie_value, failed, note, quiet_note, redirect, refusal, session_cookie, set_cookie,
    with_note,
};
use crate::oidc::{CALLBACK_PATH, Callback};
use crate::sessions::Credential;
use crate::state::AdminState;

/// The cookie holding a started sign-in's state until the provider sends the browser
/// back: `SameSite=Lax`, as that return is a navigation from the provider's site.
const STATE_COOKIE: &str = "reliq_oidc_state";

fn state_cookie(state: &AdminState, value: &str, max_age: u64) -> String {
    let secure = if state.secure_cookies { "; Secure" } else { "" };
    format!(
        "{STATE_COOKIE}={value}; HttpOnly; SameSite=Lax; Path={CALLBACK_PATH}; Max-Age={max_age}{secure}"
    )
}

fn not_configured(action: &'static str) -> Page {
    refusal(
        note(action, None),
        StatusCode::NOT_FOUND,
        "single sign-on is not configured on this server (the `[oidc]` settings)".into(),
    )
}

/// `GET /console/oidc/start`: off to the provider.
pub(super) async fn start(State(state): State<Arc<AdminState>>) -> Page {
    let action = "console-oidc-start";
    let Some(oidc) = &state.oidc else {
        return not_configured(action);
    };
    match oidc.start().await {
        Ok((login_state, url)) => {
            let mut response = redirect(quiet_note(action), &url);
            set_cookie(&mut response, &state_cookie(&state, &login_state, 600));
            response
        }
        Err(e) => {
            let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_GATEWAY);
            refusal(note(action, None), status, e.to_string())
        }
    }
}

/// `GET /console/oidc/callback`: back from the provider; a session when all checks out.
pub(super) async fn callback(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Page {
    let action = "console-oidc-callback";
    let Some(oidc) = &state.oidc else {
        return not_configured(action);
    };
    let mut note = note(action, None);
    let callback: Callback =
        serde_urlencoded::from_str(query.as_deref().unwrap_or("")).unwrap_or_default();
    let signed = match oidc
        .finish(&callback, cookie_value(&headers, STATE_COOKIE).as_deref())
        .await
    {
        Ok(signed) => signed,
        Err(e) => {
            let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::UNAUTHORIZED);
            let mut response = refusal(note, status, e.to_string());
            set_cookie(&mut response, &state_cookie(&state, "", 0));
            return response;
        }
    };
    note.actor = Some(signed.who.clone());
    let name = signed.who.name.clone();
    let id = match state.sessions.start(Credential::Provider(signed)) {
        Ok(id) => id,
        Err(e) => return failed(note, e),
    };
    // A page, not a redirect: the session cookie is `SameSite=Strict`, and a redirect
    // here would still count as the provider's cross-site navigation, arriving without
    // it. The page's own move to the overview is same-site.
    let mut response = with_note(
        pages::signed_in(&name).into_response(),
        StatusCode::OK,
        note,
    );
    set_cookie(&mut response, &session_cookie(&state, &id));
    set_cookie(&mut response, &state_cookie(&state, "", 0));
    response
}

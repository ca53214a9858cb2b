//! Single sign-on for the web console: OpenID Connect's authorization-code flow with PKCE.
//!
//! 1. `GET /console/oidc/start` makes a state, a nonce and a PKCE verifier, keeps them
//!    in memory for ten minutes, puts the state in a cookie (`SameSite=Lax`: the
//!    provider's redirect back is a cross-site navigation and must bring it) and sends
//!    the browser to the provider's authorization endpoint.
//! 2. The provider sends the browser back to `/console/oidc/callback` with a code. The
//!    state must match the cookie's (a sign-in this browser started, not a link someone
//!    sent) and the `iss` parameter, when the provider sends one, the issuer (RFC 9207,
//!    mix-up). The code is exchanged, with the verifier, at the token endpoint (the
//!    client secret as HTTP basic auth); the ID token's signature (the provider's JWKS,
//!    fetched again once when a key is unknown: rotation), issuer, audience, expiry and
//!    nonce are checked.
//! 3. The roles claim (`roles` by default; a claim name, or a dotted path into nested
//!    claims such as Keycloak's `realm_access.roles`) maps to the highest reliq role any
//!    of its values is listed under. When the ID token lacks the claim it is read from
//!    the userinfo endpoint (whose `sub` must be the ID token's). No mapped value: 403.
//! 4. The console session lasts as long as the provider's access token (never more than
//!    the console's 12 hours): when it expires at the provider, the next page asks for a
//!    sign-in again. Sign-out ends the session here and, when the provider offers
//!    RP-initiated logout, at the provider too.
//!
//! The API and scripts keep using bearer tokens; single sign-on is for people.
//!
//! ```toml
//! [oidc]
//! issuer = "https://login.example.com/realms/ops"
//! client_id = "reliq-console"
//! client_secret_file = "/run/secrets/reliq-oidc"   # or RELIQ_OIDC_CLIENT_SECRET
//! redirect_url = "https://reliq.example.com/console/oidc/callback"
//! roles_claim = "realm_access.roles"
//! [oidc.roles]
//! reader = ["sre"]
//! operator = ["sre-oncall"]
//! admin = ["sre-leads"]
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use base64::Engine as _;
use openidconnect::core::{CoreAuthenticationFlow, CoreClient, CoreIdToken};
use openidconnect::{
    AuthorizationCode, ClientId, ClientSecret, CsrfToken, HttpRequest, HttpResponse, IssuerUrl,
    LogoutRequest, Nonce, OAuth2TokenResponse as _, PkceCodeChallenge, PkceCodeVerifier,
    PostLogoutRedirectUrl, ProviderMetadataWithLogout, RedirectUrl, Scope, TokenResponse as _,
};
use reliq_core::seam::lock;
use serde::Deserialize;
use serde_json::Value;

use crate::auth::{Principal, Role};
use crate::error::AdminError;

/// Where the provider sends the browser back (the `redirect_url`'s path must be this).
pub const CALLBACK_PATH: &str = "/console/oidc/callback";

/// Where the provider sends the browser after signing out there (register it with the
/// provider as a post-logout redirect URI, on the `redirect_url`'s origin).
pub const SIGNED_OUT_PATH: &str = "/console/sign-in";

/// How long a started sign-in may take at the provider.
const PENDING_TTL: Duration = Duration::from_secs(600);

/// Started sign-ins kept at most (the start page needs no credential: a bound on memory).
const PENDING_MAX: usize = 10_000;

/// How long the provider's metadata and keys are trusted before they are fetched again.
const METADATA_TTL: Duration = Duration::from_secs(3600);

/// The `[oidc]` table of `reliq admin serve`'s config file.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OidcSettings {
    /// The provider's issuer URL (its discovery document is under it).
    pub issuer: String,
    /// This console's client id at the provider.
    pub client_id: String,
    /// A file holding the client secret (a mounted secret); none for a public client.
    #[serde(default)]
    pub client_secret_file: Option<PathBuf>,
    /// The client secret itself (from `RELIQ_OIDC_CLIENT_SECRET`; never in the file).
    #[serde(skip)]
    pub client_secret: Option<String>,
    /// This console's callback as the browser reaches it:
    /// `https://<host>/console/oidc/callback`.
    pub redirect_url: String,
    /// Scopes asked for besides `openid` (default `profile`, `roles`).
    #[serde(default = "default_scopes")]
    pub scopes: Vec<String>,
    /// The claim holding the user's roles or groups: a name, or a dotted path.
    #[serde(default = "default_roles_claim")]
    pub roles_claim: String,
    /// The claim naming the user in the audit log (default `preferred_username`; `sub`
    /// when it is missing).
    #[serde(default = "default_name_claim")]
    pub name_claim: String,
    /// Which claim values make a reader, an operator, an admin.
    #[serde(default)]
    pub roles: RoleMap,
    /// A PEM file of CA certificates the provider's TLS certificate may chain to, besides
    /// the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for OidcSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OidcSettings")
            .field("issuer", &self.issuer)
            .field("client_id", &self.client_id)
            .field("client_secret_file", &self.client_secret_file)
            .field("client_secret", &self.client_secret.as_ref().map(|_| "…"))
            .field("redirect_url", &self.redirect_url)
            .field("roles_claim", &self.roles_claim)
            .finish_non_exhaustive()
    }
}

impl OidcSettings {
    /// Sign-in at `issuer` as client `client_id`, called back at `redirect_url`; the
    /// defaults for the rest (no secret: set `client_secret` or `client_secret_file`).
    pub fn new(issuer: &str, client_id: &str, redirect_url: &str) -> Self {
        Self {
            issuer: issuer.into(),
            client_id: client_id.into(),
            client_secret_file: None,
            client_secret: None,
            redirect_url: redirect_url.into(),
            scopes: default_scopes(),
            roles_claim: default_roles_claim(),
            name_claim: default_name_claim(),
            roles: RoleMap::default(),
            ca_file: None,
        }
    }
}

fn default_scopes() -> Vec<String> {
    vec!["profile".into(), "roles".into()]
}
fn default_roles_claim() -> String {
    "roles".into()
}
fn default_name_claim() -> String {
    "preferred_username".into()
}

/// Which values of the roles claim make each reliq role (a user gets the highest).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleMap {
    /// Default `["reliq-reader"]`.
    #[serde(default)]
    pub reader: Vec<String>,
    /// Default `["reliq-operator"]`.
    #[serde(default)]
    pub operator: Vec<String>,
    /// Default `["reliq-admin"]`.
    #[serde(default)]
    pub admin: Vec<String>,
}

impl Default for RoleMap {
    fn default() -> Self {
        Self {
            reader: vec!["reliq-reader".into()],
            operator: vec!["reliq-operator".into()],
            admin: vec!["reliq-admin".into()],
        }
    }
}

impl RoleMap {
    /// The highest role any of `values` is listed under.
    pub fn role_of<'a>(&self, values: impl IntoIterator<Item = &'a str> + Clone) -> Option<Role> {
        let listed = |names: &[String]| {
            values
                .clone()
                .into_iter()
                .any(|v| names.iter().any(|n| n == v))
        };
        if listed(&self.admin) {
            Some(Role::Admin)
        } else if listed(&self.operator) {
            Some(Role::Operator)
        } else if listed(&self.reader) {
            Some(Role::Reader)
        } else {
            None
        }
    }
}

/// Why a sign-in through the provider failed (the console shows it; the audit log keeps it).
#[derive(Debug, thiserror::Error)]
pub enum OidcError {
    /// The provider's discovery document or keys could not be read.
    #[error("the identity provider `{issuer}` could not be read: {why}")]
    Provider {
        /// The configured issuer.
        issuer: String,
        /// What went wrong.
        why: String,
    },
    /// A callback for no sign-in this browser started (or one older than ten minutes).
    #[error(
        "this sign-in was not started in this browser or took longer than ten minutes: start again"
    )]
    UnknownState,
    /// Too many sign-ins are in progress.
    #[error("too many sign-ins in progress: try again in a minute")]
    Busy,
    /// The provider answered the callback with an error (the user declined, …).
    #[error("the identity provider refused the sign-in: {0}")]
    Refused(String),
    /// The callback names another issuer than this console's provider.
    #[error("the callback comes from issuer `{0}`, not this console's provider")]
    WrongIssuer(String),
    /// The code exchange at the token endpoint failed.
    #[error("exchanging the code at the identity provider failed: {0}")]
    Exchange(String),
    /// The ID token failed a check (signature, issuer, audience, expiry, nonce).
    #[error("the identity provider's ID token is not valid: {0}")]
    IdToken(String),
    /// The user's roles claim maps to no reliq role.
    #[error(
        "`{name}` signed in, but no value of the `{claim}` claim ({values}) is mapped to a reliq role"
    )]
    NoRole {
        /// The user, as the name claim says.
        name: String,
        /// The roles claim.
        claim: String,
        /// Its values, for the operator to compare with the mapping.
        values: String,
    },
}

impl OidcError {
    /// The HTTP status the console answers with.
    pub(crate) fn status(&self) -> u16 {
        match self {
            Self::UnknownState => 400,
            Self::Refused(_) | Self::WrongIssuer(_) | Self::IdToken(_) => 401,
            Self::NoRole { .. } => 403,
            Self::Busy => 503,
            Self::Provider { .. } | Self::Exchange(_) => 502,
        }
    }
}

/// A console user signed in through the provider.
#[derive(Clone)]
pub(crate) struct SignedIn {
    pub(crate) who: Principal,
    /// When the provider's token expires: the session ends then.
    pub(crate) until: SystemTime,
    /// The ID token, the hint for the provider's sign-out.
    id_token: String,
}

/// A sign-in sent to the provider and not back yet.
struct Pending {
    verifier: PkceCodeVerifier,
    nonce: Nonce,
    started: Instant,
}

/// What discovery found, and when.
struct Discovered {
    metadata: ProviderMetadataWithLogout,
    at: Instant,
}

/// The console's OpenID Connect client.
pub struct Oidc {
    settings: OidcSettings,
    issuer: IssuerUrl,
    redirect: RedirectUrl,
    post_logout: PostLogoutRedirectUrl,
    secret: Option<ClientSecret>,
    http: ProviderHttp,
    discovered: tokio::sync::Mutex<Option<Discovered>>,
    pending: Mutex<HashMap<String, Pending>>,
}

impl std::fmt::Debug for Oidc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Oidc")
            .field("issuer", &self.settings.issuer)
            .field("client_id", &self.settings.client_id)
            .finish_non_exhaustive()
    }
}

/// An HTTP exchange with the provider that failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct HttpFailure(String);

fn invalid(field: &'static str, value: &str, expected: impl Into<String>) -> AdminError {
    AdminError::InvalidInput {
        field,
        value: value.chars().take(200).collect(),
        expected: expected.into(),
    }
}

impl Oidc {
    /// Check `settings` (an error names the field) and make the client. Nothing is
    /// fetched yet: the provider is asked at the first sign-in, so a provider that is down
    /// when the server starts delays sign-ins, not the server.
    pub fn new(mut settings: OidcSettings) -> Result<Self, AdminError> {
        let issuer = IssuerUrl::new(settings.issuer.clone())
            .map_err(|e| invalid("oidc.issuer", &settings.issuer, format!("a URL ({e})")))?;
        if !matches!(issuer.url().scheme(), "https" | "http") {
            return Err(invalid("oidc.issuer", &settings.issuer, "an http(s) URL"));
        }
        if settings.client_id.is_empty() {
            return Err(invalid(
                "oidc.client_id",
                "",
                "the console's client id at the provider",
            ));
        }
        let redirect = RedirectUrl::new(settings.redirect_url.clone()).map_err(|e| {
            invalid(
                "oidc.redirect_url",
                &settings.redirect_url,
                format!("a URL ({e})"),
            )
        })?;
        if redirect.url().path() != CALLBACK_PATH {
            return Err(invalid(
                "oidc.redirect_url",
                &settings.redirect_url,
                format!("this server's callback, `https://<host>{CALLBACK_PATH}`"),
            ));
        }
        let mut signed_out = redirect.url().clone();
        signed_out.set_path(SIGNED_OUT_PATH);
        signed_out.set_query(None);
        let post_logout = PostLogoutRedirectUrl::from_url(signed_out);
        if let Some(path) = &settings.client_secret_file {
            let text = std::fs::read_to_string(path).map_err(|source| AdminError::File {
                what: "oidc.client_secret_file",
                path: path.display().to_string(),
                source,
            })?;
            settings.client_secret = Some(text.trim().to_owned());
        }
        let secret = settings
            .client_secret
            .clone()
            .filter(|s| !s.is_empty())
            .map(ClientSecret::new);
        let mapped = [
            &settings.roles.reader,
            &settings.roles.operator,
            &settings.roles.admin,
        ];
        if mapped.iter().all(|names| names.is_empty()) {
            return Err(invalid(
                "oidc.roles",
                "(empty)",
                "claim values for at least one of reader, operator, admin",
            ));
        }
        if settings.roles_claim.is_empty() {
            return Err(invalid(
                "oidc.roles_claim",
                "",
                "a claim name or a dotted path",
            ));
        }
        let http = http_client(settings.ca_file.as_deref())?;
        Ok(Self {
            settings,
            issuer,
            redirect,
            post_logout,
            secret,
            http: ProviderHttp(http),
            discovered: tokio::sync::Mutex::new(None),
            pending: Mutex::new(HashMap::new()),
        })
    }

    /// The provider's origin (`https://host:port`): the console's pages may send forms
    /// there (sign-out redirects to the provider).
    pub(crate) fn provider_origin(&self) -> String {
        self.issuer.url().origin().ascii_serialization()
    }

    /// The provider's metadata and keys, fetched when missing, older than an hour or
    /// `stale` (a key the cached set lacks).
    async fn metadata(&self, stale: bool) -> Result<ProviderMetadataWithLogout, OidcError> {
        let mut cached = self.discovered.lock().await;
        if let Some(d) = cached.as_ref()
            && !stale
            && d.at.elapsed() < METADATA_TTL
        {
            return Ok(d.metadata.clone());
        }
        let metadata = ProviderMetadataWithLogout::discover_async(self.issuer.clone(), &self.http)
            .await
            .map_err(|e| OidcError::Provider {
                issuer: self.settings.issuer.clone(),
                why: reliq_core::ErrorChain(&e).to_string(),
            })?;
        *cached = Some(Discovered {
            metadata: metadata.clone(),
            at: Instant::now(),
        });
        Ok(metadata)
    }

    fn client(&self, metadata: ProviderMetadataWithLogout) -> ConsoleClient {
        CoreClient::from_provider_metadata(
            metadata,
            ClientId::new(self.settings.client_id.clone()),
            self.secret.clone(),
        )
        .set_redirect_uri(self.redirect.clone())
    }

    /// Start a sign-in: the state (for the browser's cookie) and the provider's URL to
    /// send the browser to.
    pub(crate) async fn start(&self) -> Result<(String, String), OidcError> {
        let metadata = self.metadata(false).await?;
        let client = self.client(metadata);
        let (challenge, verifier) = PkceCodeChallenge::new_random_sha256();
        let (url, state, nonce) = client
            .authorize_url(
                CoreAuthenticationFlow::AuthorizationCode,
                CsrfToken::new_random,
                Nonce::new_random,
            )
            .add_scopes(self.settings.scopes.iter().cloned().map(Scope::new))
            .set_pkce_challenge(challenge)
            .url();
        let mut pending = lock(&self.pending);
        pending.retain(|_, p| p.started.elapsed() < PENDING_TTL);
        if pending.len() >= PENDING_MAX {
            return Err(OidcError::Busy);
        }
        pending.insert(
            state.secret().clone(),
            Pending {
                verifier,
                nonce,
                started: Instant::now(),
            },
        );
        Ok((state.secret().clone(), url.to_string()))
    }

    /// Finish a sign-in from the provider's callback: `cookie_state` is the state the
    /// browser's cookie holds.
    pub(crate) async fn finish(
        &self,
        callback: &Callback,
        cookie_state: Option<&str>,
    ) -> Result<SignedIn, OidcError> {
        // The state first: a callback this browser did not start is refused before
        // anything else is looked at (and its pending entry is not spent).
        let state = callback.state.as_deref().ok_or(OidcError::UnknownState)?;
        if cookie_state != Some(state) {
            return Err(OidcError::UnknownState);
        }
        let pending = lock(&self.pending)
            .remove(state)
            .filter(|p| p.started.elapsed() < PENDING_TTL)
            .ok_or(OidcError::UnknownState)?;
        if let Some(error) = &callback.error {
            let why = match &callback.error_description {
                Some(d) => format!("{error}: {d}"),
                None => error.clone(),
            };
            return Err(OidcError::Refused(why));
        }
        if let Some(iss) = &callback.iss
            && iss != self.issuer.as_str()
        {
            return Err(OidcError::WrongIssuer(iss.clone()));
        }
        let code = callback
            .code
            .clone()
            .ok_or_else(|| OidcError::Refused("the callback carries no code".into()))?;
        let metadata = self.metadata(false).await?;
        let client = self.client(metadata.clone());
        let tokens = client
            .exchange_code(AuthorizationCode::new(code))
            .map_err(|e| OidcError::Exchange(e.to_string()))?
            .set_pkce_verifier(pending.verifier)
            .request_async(&self.http)
            .await
            .map_err(|e| OidcError::Exchange(exchange_failure(&e)))?;
        let id_token = tokens
            .id_token()
            .ok_or_else(|| OidcError::IdToken("the token response holds no ID token".into()))?;
        let algorithms = metadata.id_token_signing_alg_values_supported().clone();
        let verified = {
            let verifier = client
                .id_token_verifier()
                .set_allowed_algs(algorithms.clone());
            match id_token.claims(&verifier, &pending.nonce) {
                Ok(claims) => Ok(claims.expiration()),
                Err(first) => Err(first.to_string()),
            }
        };
        let expires = match verified {
            Ok(exp) => exp,
            Err(first) => {
                // Perhaps the provider rotated its keys: fetch them once more.
                let fresh = self.client(self.metadata(true).await?);
                let verifier = fresh.id_token_verifier().set_allowed_algs(algorithms);
                id_token
                    .claims(&verifier, &pending.nonce)
                    .map_err(|e| {
                        OidcError::IdToken(format!(
                            "{e} (before the keys were fetched again: {first})"
                        ))
                    })?
                    .expiration()
            }
        };
        let id_token_text = id_token.to_string();
        let mut claims = payload(&id_token_text)?;
        if claim(&claims, &self.settings.roles_claim).is_none()
            && let Some(userinfo) = metadata.userinfo_endpoint()
        {
            let info = self
                .userinfo(userinfo.url().as_str(), tokens.access_token().secret())
                .await?;
            if info.get("sub") != claims.get("sub") {
                return Err(OidcError::IdToken(
                    "the userinfo endpoint answered for another subject".into(),
                ));
            }
            if let Some(roles) = claim(&info, &self.settings.roles_claim).cloned()
                && let Value::Object(map) = &mut claims
            {
                map.insert(self.settings.roles_claim.clone(), roles);
            }
        }
        let name = claim(&claims, &self.settings.name_claim)
            .or_else(|| claims.get("sub"))
            .and_then(Value::as_str)
            .unwrap_or("(no name)")
            .to_owned();
        let values = claim_values(claim(&claims, &self.settings.roles_claim));
        let role = self
            .settings
            .roles
            .role_of(values.iter().map(String::as_str))
            .ok_or_else(|| OidcError::NoRole {
                name: name.clone(),
                claim: self.settings.roles_claim.clone(),
                values: if values.is_empty() {
                    "none".into()
                } else {
                    values.join(", ")
                },
            })?;
        let now = SystemTime::now();
        let id_expiry = SystemTime::from(expires);
        let token_expiry = tokens.expires_in().map(|d| now + d).unwrap_or(id_expiry);
        Ok(SignedIn {
            who: Principal {
                name: format!("oidc:{name}"),
                role,
            },
            // A session ends after 12 hours in any case (the console's own bound).
            until: token_expiry,
            id_token: id_token_text,
        })
    }

    /// The userinfo endpoint's claims (JSON; a signed userinfo answer is not read).
    async fn userinfo(&self, url: &str, access_token: &str) -> Result<Value, OidcError> {
        let failed = |why: String| OidcError::IdToken(format!("the userinfo endpoint: {why}"));
        let response = self
            .http
            .0
            .get(url)
            .bearer_auth(access_token)
            .send()
            .await
            .map_err(|e| failed(e.without_url().to_string()))?;
        if !response.status().is_success() {
            return Err(failed(format!("HTTP {}", response.status())));
        }
        response
            .json()
            .await
            .map_err(|e| failed(format!("not JSON claims: {}", e.without_url())))
    }

    /// Where to send the browser to sign out at the provider too, when it offers that.
    pub(crate) async fn sign_out_url(&self, signed: &SignedIn) -> Option<String> {
        let metadata = self.metadata(false).await.ok()?;
        let endpoint = metadata
            .additional_metadata()
            .end_session_endpoint
            .clone()?;
        let hint: CoreIdToken = signed.id_token.parse().ok()?;
        Some(
            LogoutRequest::from(endpoint)
                .set_id_token_hint(&hint)
                .set_client_id(ClientId::new(self.settings.client_id.clone()))
                .set_post_logout_redirect_uri(self.post_logout.clone())
                .http_get_url()
                .to_string(),
        )
    }
}

/// The provider's callback query.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Callback {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
    error_description: Option<String>,
    iss: Option<String>,
}

/// The token endpoint's refusal as the provider said it (its error code and description).
fn exchange_failure<E: std::error::Error + 'static>(
    e: &openidconnect::RequestTokenError<
        E,
        openidconnect::StandardErrorResponse<openidconnect::core::CoreErrorResponseType>,
    >,
) -> String {
    match e {
        openidconnect::RequestTokenError::ServerResponse(r) => match r.error_description() {
            Some(d) => format!("{}: {d}", r.error()),
            None => r.error().to_string(),
        },
        other => reliq_core::ErrorChain(other).to_string(),
    }
}

/// A verified ID token's claims as JSON (read after the signature check, for claims the
/// typed view does not name).
fn payload(id_token: &str) -> Result<Value, OidcError> {
    let part = id_token
        .split('.')
        .nth(1)
        .ok_or_else(|| OidcError::IdToken("not a compact JWT".into()))?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(part.trim_end_matches('='))
        .map_err(|e| OidcError::IdToken(format!("payload: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| OidcError::IdToken(format!("payload: {e}")))
}

/// The claim `path` names: a top-level claim of that exact name (names like
/// `https://example.com/roles` hold dots), else a dotted path into nested objects.
pub(crate) fn claim<'a>(claims: &'a Value, path: &str) -> Option<&'a Value> {
    claims
        .get(path)
        .or_else(|| path.split('.').try_fold(claims, |at, key| at.get(key)))
}

/// A roles claim's values: an array of strings, or one string.
fn claim_values(value: Option<&Value>) -> Vec<String> {
    match value {
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        Some(Value::String(s)) => vec![s.clone()],
        _ => Vec::new(),
    }
}

/// The HTTP client for the provider: no redirects followed (a redirected token request
/// would carry the code elsewhere), a bound on every exchange, the platform's roots plus
/// `ca_file`'s.
fn http_client(ca_file: Option<&std::path::Path>) -> Result<reqwest::Client, AdminError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let config = |why: String| invalid("oidc.ca_file", "", why);
    let extra: Vec<CertificateDer<'static>> = match ca_file {
        None => Vec::new(),
        Some(path) => CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| AdminError::File {
                what: "oidc.ca_file",
                path: path.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            })?,
    };
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let verifier =
        rustls_platform_verifier::Verifier::new_with_extra_roots(extra, provider.clone())
            .map_err(|e| config(format!("TLS setup failed: {e}")))?;
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| config(format!("TLS setup failed: {e}")))?
        .dangerous() // only to install the platform verifier, which verifies fully
        .with_custom_certificate_verifier(std::sync::Arc::new(verifier))
        .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| config(format!("HTTP client setup failed: {e}")))
}

/// The client built from a provider's metadata: its authorization URL is known, its
/// token and userinfo URLs may be (discovery makes them optional).
type ConsoleClient = openidconnect::core::CoreClient<
    openidconnect::EndpointSet,
    openidconnect::EndpointNotSet,
    openidconnect::EndpointNotSet,
    openidconnect::EndpointNotSet,
    openidconnect::EndpointMaybeSet,
    openidconnect::EndpointMaybeSet,
>;

/// The console's HTTP client as `openidconnect` wants it. A named type with a boxed
/// `Send` future rather than a closure: a closure's future borrows the client for one
/// specific lifetime, which axum's `Send` handler bound cannot see through.
#[derive(Clone)]
struct ProviderHttp(reqwest::Client);

impl<'c> openidconnect::AsyncHttpClient<'c> for ProviderHttp {
    type Error = HttpFailure;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<HttpResponse, HttpFailure>> + Send + 'c>,
    >;

    fn call(&'c self, request: HttpRequest) -> Self::Future {
        Box::pin(send(&self.0, request))
    }
}

/// One exchange with the provider.
async fn send(http: &reqwest::Client, request: HttpRequest) -> Result<HttpResponse, HttpFailure> {
    let (parts, body) = request.into_parts();
    let response = http
        .request(parts.method, parts.uri.to_string())
        .headers(parts.headers)
        .body(body)
        .send()
        .await
        .map_err(|e| HttpFailure(reliq_core::ErrorChain(&e.without_url()).to_string()))?;
    let mut answer = axum::http::Response::builder().status(response.status());
    for (name, value) in response.headers() {
        answer = answer.header(name, value);
    }
    let body = response
        .bytes()
        .await
        .map_err(|e| HttpFailure(e.without_url().to_string()))?;
    answer
        .body(body.to_vec())
        .map_err(|e| HttpFailure(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_listed_role_wins_and_unlisted_values_give_none() {
        let map = RoleMap::default();
        assert_eq!(map.role_of(["staff", "reliq-reader"]), Some(Role::Reader));
        assert_eq!(
            map.role_of(["reliq-reader", "reliq-admin", "reliq-operator"]),
            Some(Role::Admin)
        );
        assert_eq!(map.role_of(["staff"]), None);
        assert_eq!(map.role_of([]), None);
    }

    #[test]
    fn claims_are_found_by_name_or_dotted_path() {
        let claims = serde_json::json!({
            "roles": ["a"],
            "realm_access": {"roles": ["b", "c"]},
            "https://example.com/groups": "d",
        });
        assert_eq!(claim_values(claim(&claims, "roles")), ["a"]);
        assert_eq!(
            claim_values(claim(&claims, "realm_access.roles")),
            ["b", "c"]
        );
        assert_eq!(
            claim_values(claim(&claims, "https://example.com/groups")),
            ["d"]
        );
        assert!(claim(&claims, "realm_access.missing").is_none());
    }

    fn settings() -> OidcSettings {
        OidcSettings {
            client_secret: Some("s".into()),
            ..OidcSettings::new(
                "https://login.example.com/realms/ops",
                "reliq-console",
                "https://reliq.example.com/console/oidc/callback",
            )
        }
    }

    #[test]
    fn bad_settings_fail_naming_the_field() {
        let field = |s: OidcSettings| match Oidc::new(s) {
            Err(AdminError::InvalidInput { field, .. }) => field,
            other => panic!("not refused with a field: {other:?}"),
        };
        assert_eq!(
            field(OidcSettings {
                issuer: "not a url".into(),
                ..settings()
            }),
            "oidc.issuer"
        );
        assert_eq!(
            field(OidcSettings {
                redirect_url: "https://reliq.example.com/elsewhere".into(),
                ..settings()
            }),
            "oidc.redirect_url"
        );
        assert_eq!(
            field(OidcSettings {
                roles: RoleMap {
                    reader: vec![],
                    operator: vec![],
                    admin: vec![]
                },
                ..settings()
            }),
            "oidc.roles"
        );
        let oidc = Oidc::new(settings()).expect("good settings");
        assert_eq!(oidc.provider_origin(), "https://login.example.com");
        assert_eq!(
            oidc.post_logout.as_str(),
            "https://reliq.example.com/console/sign-in"
        );
    }
}

//! A small client for RabbitMQ's management HTTP API ([reqwest]): probe the server
//! version, read queue counters, set and delete policies, close connections (tests).
//!
//! `http://` and `https://` (rustls on ring, the platform's trust store) are accepted;
//! credentials come from the URL's userinfo and are sent as HTTP basic auth, never logged.

use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBuilder};
use reliq_core::{BrokerError, seam::secrets::percent_decode};
use reqwest::{Method, StatusCode, Url};
use serde_json::Value;

use crate::options::{LoadedTls, Tls, encode_segment};

/// How long one management API request may take: it answers slowly on a busy broker
/// with many queues and policies, and is only used at declaration time.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// A management API endpoint, e.g. `http://guest:guest@127.0.0.1:15672`.
#[derive(Clone)]
pub struct Management {
    base: Url,
    user: String,
    password: String,
    http: reqwest::Client,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `base` has its credentials stripped; never print them.
        f.debug_struct("Management")
            .field("base", &self.base.as_str())
            .finish_non_exhaustive()
    }
}

fn config(reason: impl Into<String>) -> BrokerError {
    BrokerError::Config {
        field: "management_url".into(),
        reason: reason.into(),
    }
}

/// A policy as the management API stores it (`PUT /api/policies/<vhost>/<name>`).
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// The policy name.
    pub name: String,
    /// The queue-name regex it applies to.
    pub pattern: String,
    /// `queues`, `quorum_queues`, `classic_queues`, …
    pub apply_to: String,
    /// Highest priority wins when several policies match a queue.
    pub priority: i32,
    /// The settings (`delivery-limit`, `message-ttl`, …).
    pub definition: serde_json::Map<String, Value>,
}

impl Management {
    /// Parse `http[s]://[user:password@]host:port[/]`; `https` trusts the platform's
    /// certificate store.
    pub fn new(url: &str) -> Result<Self, BrokerError> {
        Self::with_tls(url, &Tls::default())
    }

    /// [`Management::new`] trusting `tls`'s CA bundle too, and presenting its client
    /// certificate (a management listener with `ssl_options.verify = verify_peer`).
    pub fn with_tls(url: &str, tls: &Tls) -> Result<Self, BrokerError> {
        Self::configured(url, &tls.load()?)
    }

    pub(crate) fn configured(url: &str, tls: &LoadedTls) -> Result<Self, BrokerError> {
        let mut base = Url::parse(url).map_err(|e| config(format!("not a URL: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(config("expected http://… or https://…"));
        }
        if base.host_str().is_none_or(str::is_empty) {
            return Err(config("expected http://user:password@host:port"));
        }
        let user = percent_decode(base.username()).into_owned();
        let password = percent_decode(base.password().unwrap_or("")).into_owned();
        // Strip the credentials: they go in the Authorization header, and the URL may end
        // up in an error message.
        let _ = base.set_username("");
        let _ = base.set_password(None);
        base.set_path("/");
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .tls_backend_preconfigured(tls.rustls()?)
            .build()
            .map_err(|e| config(format!("HTTP client setup failed: {e}")))?;
        Ok(Self {
            base,
            user,
            password,
            http,
        })
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, String), BrokerError> {
        let url = self
            .base
            .join(path.trim_start_matches('/'))
            .map_err(|e| config(format!("bad path {path}: {e}")))?;
        let mut req = self
            .http
            .request(method, url)
            .basic_auth(&self.user, Some(&self.password));
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.map_err(|e| {
            if e.is_timeout() {
                BrokerError::Timeout(REQUEST_TIMEOUT)
            } else {
                BrokerError::connection(format!("management API: {e}")).caused_by(e)
            }
        })?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .map_err(|e| BrokerError::connection(format!("management API: {e}")).caused_by(e))?;
        Ok((status, text))
    }

    fn refused(method: &str, path: &str, status: StatusCode, body: &str) -> BrokerError {
        let said = format!(
            "management API {method} {path}: HTTP {status}: {}",
            body.chars().take(200).collect::<String>()
        );
        match status {
            // A wrong password, or a user without the tag (`policymaker`, `management`)
            // or the vhost permission the call needs.
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => BrokerError::Unauthorized {
                resource: format!("management API {path}"),
                reason: said,
                source: None,
            },
            _ => BrokerError::rejected(said),
        }
    }

    /// `GET path`, tried again (up to three times, 100 ms backoff) on a server error or
    /// a failed connection: a busy management API answers 500 now and then, and a GET
    /// changes nothing.
    async fn get_raw(&self, path: &str) -> Result<(StatusCode, String), BrokerError> {
        let mut delays = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_times(3)
            .build();
        loop {
            let answer = self.request(Method::GET, path, None).await;
            let retry = match &answer {
                Ok((status, _)) => status.is_server_error(),
                Err(e) => matches!(e, BrokerError::Connection { .. } | BrokerError::Timeout(_)),
            };
            match delays.next() {
                Some(delay) if retry => {
                    tracing::debug!(path, "management API GET failed; trying again");
                    tokio::time::sleep(delay).await;
                }
                _ => return answer,
            }
        }
    }

    /// `GET path` → JSON.
    pub async fn get(&self, path: &str) -> Result<Value, BrokerError> {
        let (status, body) = self.get_raw(path).await?;
        if status != StatusCode::OK {
            return Err(Self::refused("GET", path, status, &body));
        }
        serde_json::from_str(&body).map_err(|e| BrokerError::Other(Box::new(e)))
    }

    /// `GET path` → JSON, or `None` on HTTP 404 (no such object).
    pub async fn get_if_exists(&self, path: &str) -> Result<Option<Value>, BrokerError> {
        let (status, body) = self.get_raw(path).await?;
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if status != StatusCode::OK {
            return Err(Self::refused("GET", path, status, &body));
        }
        serde_json::from_str(&body)
            .map(Some)
            .map_err(|e| BrokerError::Other(Box::new(e)))
    }

    /// `PUT path` with a JSON body.
    pub async fn put(&self, path: &str, body: &Value) -> Result<(), BrokerError> {
        let (status, text) = self.request(Method::PUT, path, Some(body)).await?;
        if !status.is_success() {
            return Err(Self::refused("PUT", path, status, &text));
        }
        Ok(())
    }

    /// `DELETE path` (404 counts as done).
    pub async fn delete(&self, path: &str) -> Result<(), BrokerError> {
        let (status, text) = self.request(Method::DELETE, path, None).await?;
        if !status.is_success() && status != StatusCode::NOT_FOUND {
            return Err(Self::refused("DELETE", path, status, &text));
        }
        Ok(())
    }

    /// Create or replace a policy in `vhost`.
    pub async fn put_policy(&self, vhost: &str, policy: &Policy) -> Result<(), BrokerError> {
        let body = serde_json::json!({
            "pattern": policy.pattern,
            "definition": policy.definition,
            "priority": policy.priority,
            "apply-to": policy.apply_to,
        });
        self.put(
            &format!(
                "/api/policies/{}/{}",
                encode_segment(vhost),
                encode_segment(&policy.name)
            ),
            &body,
        )
        .await
    }

    /// Delete a policy (a missing one counts as deleted).
    pub async fn delete_policy(&self, vhost: &str, name: &str) -> Result<(), BrokerError> {
        self.delete(&format!(
            "/api/policies/{}/{}",
            encode_segment(vhost),
            encode_segment(name)
        ))
        .await
    }

    /// Force-close every connection whose client-side name (`connection_name`) is
    /// `client_name`; returns how many were closed. For tests of reconnection.
    pub async fn close_connections(&self, client_name: &str) -> Result<usize, BrokerError> {
        let list = self.get("/api/connections").await?;
        let names: Vec<String> = list
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| {
                c.pointer("/client_properties/connection_name")
                    .and_then(|v| v.as_str())
                    == Some(client_name)
            })
            .filter_map(|c| c.get("name").and_then(|v| v.as_str()).map(str::to_owned))
            .collect();
        for name in &names {
            self.delete(&format!("/api/connections/{}", encode_segment(name)))
                .await?;
        }
        Ok(names.len())
    }

    /// The broker's version (`/api/overview` → `rabbitmq_version`).
    pub async fn server_version(&self) -> Result<String, BrokerError> {
        let v = self.get("/api/overview").await?;
        v.get("rabbitmq_version")
            .and_then(|v| v.as_str())
            .map(str::to_owned)
            .ok_or_else(|| BrokerError::rejected("no rabbitmq_version in /api/overview"))
    }

    /// One queue's counters and settings (`/api/queues/<vhost>/<name>`), as JSON; its
    /// `policy` field names the policy in effect.
    pub async fn queue(&self, vhost: &str, name: &str) -> Result<Value, BrokerError> {
        self.get(&format!(
            "/api/queues/{}/{}",
            encode_segment(vhost),
            encode_segment(name)
        ))
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls_and_hides_credentials() {
        let m = Management::new("http://gu%40est:p%3Ass@127.0.0.1:15672/").unwrap();
        assert_eq!(m.base.as_str(), "http://127.0.0.1:15672/");
        assert_eq!((m.user.as_str(), m.password.as_str()), ("gu@est", "p:ss"));
        assert!(!format!("{m:?}").contains("p:ss") && !format!("{m:?}").contains("p%3Ass"));
        assert!(Management::new("https://user:pw@rabbit.example:15671").is_ok());
        assert_eq!(encode_segment("/"), "%2F");
        assert!(Management::new("ftp://x").is_err());
        assert!(Management::new("not a url").is_err());
    }
}

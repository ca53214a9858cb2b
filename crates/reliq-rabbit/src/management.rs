//! A minimal client for RabbitMQ's management HTTP API (plain `http://` only): enough to
//! probe the server version, read queue counters and set policies. It speaks HTTP/1.0 so
//! the response is never chunked, and needs no HTTP client crate.

use std::time::Duration;

use reliq_core::BrokerError;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A management API endpoint, e.g. `http://guest:guest@127.0.0.1:15672`.
#[derive(Clone)]
pub struct Management {
    authority: String,
    auth: Option<String>,
    timeout: Duration,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the credentials.
        f.debug_struct("Management")
            .field("authority", &self.authority)
            .finish_non_exhaustive()
    }
}

fn config(reason: impl Into<String>) -> BrokerError {
    BrokerError::Config {
        field: "management_url".into(),
        reason: reason.into(),
    }
}

fn base64(input: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(T[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Percent-encode one path segment (queue and vhost names).
pub fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(v) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Management {
    /// Parse `http://[user:password@]host:port[/]`.
    pub fn new(url: &str) -> Result<Self, BrokerError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| config("only http:// management URLs are supported"))?;
        let rest = rest.trim_end_matches('/');
        let (auth, authority) = match rest.rsplit_once('@') {
            Some((userinfo, host)) => {
                let (user, pass) = userinfo.split_once(':').unwrap_or((userinfo, ""));
                let creds = format!("{}:{}", percent_decode(user), percent_decode(pass));
                (Some(base64(creds.as_bytes())), host.to_owned())
            }
            None => (None, rest.to_owned()),
        };
        if authority.is_empty() || authority.contains('/') {
            return Err(config("expected http://user:password@host:port"));
        }
        Ok(Self {
            authority,
            auth,
            timeout: Duration::from_secs(5),
        })
    }

    async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<(u16, String), BrokerError> {
        let io = async {
            let mut stream = TcpStream::connect(&self.authority).await?;
            let mut req = format!("{method} {path} HTTP/1.0\r\nHost: {}\r\n", self.authority);
            if let Some(a) = &self.auth {
                req.push_str(&format!("Authorization: Basic {a}\r\n"));
            }
            if let Some(b) = body {
                req.push_str(&format!(
                    "Content-Type: application/json\r\nContent-Length: {}\r\n",
                    b.len()
                ));
            }
            req.push_str("\r\n");
            if let Some(b) = body {
                req.push_str(b);
            }
            stream.write_all(req.as_bytes()).await?;
            let mut raw = Vec::new();
            stream.read_to_end(&mut raw).await?;
            Ok::<_, std::io::Error>(raw)
        };
        let raw = tokio::time::timeout(self.timeout, io)
            .await
            .map_err(|_| BrokerError::Timeout(self.timeout))?
            .map_err(|e| BrokerError::Connection(format!("management API: {e}")))?;
        let text = String::from_utf8_lossy(&raw);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| BrokerError::Connection("management API: malformed response".into()))?;
        Ok((status, body.to_owned()))
    }

    /// `GET path` → JSON.
    pub async fn get(&self, path: &str) -> Result<serde_json::Value, BrokerError> {
        let (status, body) = self.request("GET", path, None).await?;
        if status != 200 {
            return Err(BrokerError::Rejected(format!(
                "management API GET {path}: HTTP {status}"
            )));
        }
        serde_json::from_str(&body).map_err(|e| BrokerError::Other(Box::new(e)))
    }

    /// `PUT path` with a JSON body.
    pub async fn put(&self, path: &str, body: &serde_json::Value) -> Result<(), BrokerError> {
        let (status, text) = self.request("PUT", path, Some(&body.to_string())).await?;
        if !(200..300).contains(&status) {
            return Err(BrokerError::Rejected(format!(
                "management API PUT {path}: HTTP {status}: {}",
                text.chars().take(200).collect::<String>()
            )));
        }
        Ok(())
    }

    /// `DELETE path` (404 counts as done).
    pub async fn delete(&self, path: &str) -> Result<(), BrokerError> {
        let (status, text) = self.request("DELETE", path, None).await?;
        if !(200..300).contains(&status) && status != 404 {
            return Err(BrokerError::Rejected(format!(
                "management API DELETE {path}: HTTP {status}: {}",
                text.chars().take(200).collect::<String>()
            )));
        }
        Ok(())
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
            .ok_or_else(|| BrokerError::Rejected("no rabbitmq_version in /api/overview".into()))
    }

    /// One queue's counters (`/api/queues/<vhost>/<name>`), as JSON.
    pub async fn queue(&self, vhost: &str, name: &str) -> Result<serde_json::Value, BrokerError> {
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
    fn parses_urls_and_encodes() {
        assert_eq!(base64(b"guest:guest"), "Z3Vlc3Q6Z3Vlc3Q=");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(base64(b"abc"), "YWJj");
        let m = Management::new("http://guest:guest@127.0.0.1:15672/").unwrap();
        assert_eq!(m.authority, "127.0.0.1:15672");
        assert!(!format!("{m:?}").contains("guest"));
        assert_eq!(encode_segment("/"), "%2F");
        assert!(Management::new("https://x").is_err());
    }
}

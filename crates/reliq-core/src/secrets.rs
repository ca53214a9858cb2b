//! Secrets in broker URLs: where they may come from, and how they are kept out of
//! process lists, `Debug` output, errors and logs.
//!
//! Every backend reads its settings from the URL's query (`key=value`). A setting whose
//! value is a secret can instead name where the value is:
//!
//! - `<key>.file=/run/secrets/kafka-password` — the file's contents (one trailing newline
//!   dropped), as mounted by Kubernetes or Docker secrets;
//! - `<key>.env=KAFKA_PASSWORD` — an environment variable.
//!
//! so that `ps` shows a path, not the password. Query values are percent-decoded
//! (`%26` is `&`), so a password may hold any character.
//!
//! [`redact_url`] is what every message, log line and `Debug` of a config shows: the
//! password of the user-info part and the value of every secret-looking key
//! ([`is_secret_key`]) become `***`.

use std::borrow::Cow;

/// Why a secret could not be read; names the setting, never its value.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// `<key>.file` names a file that cannot be read.
    #[error("`{key}.file`: cannot read `{path}`: {source}")]
    File {
        /// The setting (without `.file`).
        key: String,
        /// The path given.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `<key>.env` names an environment variable that is not set (or not UTF-8).
    #[error("`{key}.env`: the environment variable `{var}` is not set")]
    Env {
        /// The setting (without `.env`).
        key: String,
        /// The variable named.
        var: String,
    },
}

/// Whether a setting's value is a secret: its name holds `password`, `secret`, `token`,
/// `jaas` or `credentials`, or it is a private key in PEM (`ssl.key.pem`) or an OAUTHBEARER
/// configuration (which carries a client secret).
pub fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["password", "secret", "token", "jaas", "credentials"]
        .iter()
        .any(|w| key.contains(w))
        || matches!(
            key.as_str(),
            "ssl.key.pem" | "ssl_key" | "sasl.oauthbearer.config" | "nkey" | "seed"
        )
}

/// A query setting `key=value` with its indirection resolved: `<name>.file=PATH` gives
/// `(name, contents of PATH)`, `<name>.env=VAR` gives `(name, $VAR)`, anything else
/// `(key, value)` unchanged.
pub fn resolve_setting<'a>(
    key: &'a str,
    value: &'a str,
) -> Result<(&'a str, Cow<'a, str>), SecretError> {
    if let Some(name) = key.strip_suffix(".file") {
        let text = std::fs::read_to_string(value).map_err(|source| SecretError::File {
            key: name.to_owned(),
            path: value.to_owned(),
            source,
        })?;
        let text = text
            .strip_suffix('\n')
            .map(|t| t.strip_suffix('\r').unwrap_or(t))
            .unwrap_or(&text);
        return Ok((name, Cow::Owned(text.to_owned())));
    }
    if let Some(name) = key.strip_suffix(".env") {
        let text = std::env::var(value).map_err(|_| SecretError::Env {
            key: name.to_owned(),
            var: value.to_owned(),
        })?;
        return Ok((name, Cow::Owned(text)));
    }
    Ok((key, Cow::Borrowed(value)))
}

/// `%XX` sequences decoded (`+` stays `+`); an invalid sequence is kept as written,
/// bytes that are not UTF-8 become U+FFFD.
pub fn percent_decode(s: &str) -> Cow<'_, str> {
    percent_encoding::percent_decode_str(s).decode_utf8_lossy()
}

/// `url` with its user-info password and every secret setting's value replaced by `***`
/// (`.file` and `.env` settings keep their path or variable name: those are not secret).
///
/// ```
/// use reliq_core::seam::secrets::redact_url;
/// assert_eq!(
///     redact_url("kafka://k:9093?sasl.username=svc&sasl.password=hunter2&client.id=a"),
///     "kafka://k:9093?sasl.username=svc&sasl.password=***&client.id=a"
/// );
/// assert_eq!(redact_url("amqps://svc:hunter2@rabbit/%2f"), "amqps://svc:***@rabbit/%2f");
/// ```
pub fn redact_url(url: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut out = match (base.find("://"), base.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &base[scheme_end + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &base[..scheme_end + 3], &base[at..]),
                // A lone token before `@` (NATS `nats://TOKEN@host`) is the secret itself.
                None => format!("{}***{}", &base[..scheme_end + 3], &base[at..]),
            }
        }
        _ => base.to_owned(),
    };
    if url.contains('?') {
        out.push('?');
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _))
                    if is_secret_key(k) && !k.ends_with(".file") && !k.ends_with(".env") =>
                {
                    format!("{k}=***")
                }
                _ => pair.to_owned(),
            })
            .collect();
        out.push_str(&pairs.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_keys_are_recognised_and_others_are_not() {
        for k in [
            "sasl.password",
            "ssl.key.password",
            "sasl.oauthbearer.client.secret",
            "ssl.key.pem",
            "sasl.oauthbearer.config",
            "token",
            "sasl.jaas.config",
        ] {
            assert!(is_secret_key(k), "{k}");
        }
        for k in [
            "sasl.username",
            "ssl.ca.location",
            "client.id",
            "security.protocol",
        ] {
            assert!(!is_secret_key(k), "{k}");
        }
    }

    #[test]
    fn a_secret_comes_from_a_file_or_the_environment_and_errors_name_only_the_setting() {
        let dir = std::env::temp_dir().join(format!("reliq-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "p&ss=word\n").unwrap();
        let path = file.to_string_lossy().into_owned();
        let (k, v) = resolve_setting("sasl.password.file", &path).unwrap();
        assert_eq!((k, v.as_ref()), ("sasl.password", "p&ss=word"));
        let e = resolve_setting("sasl.password.file", "/nonexistent/reliq").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("`sasl.password.file`: cannot read `/nonexistent/reliq`"),
            "{e}"
        );
        let e = resolve_setting("sasl.password.env", "RELIQ_TEST_SURELY_UNSET").unwrap_err();
        assert_eq!(
            e.to_string(),
            "`sasl.password.env`: the environment variable `RELIQ_TEST_SURELY_UNSET` is not set"
        );
        let (k, v) = resolve_setting("client.id", "svc").unwrap();
        assert_eq!((k, v.as_ref()), ("client.id", "svc"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn values_are_percent_decoded() {
        assert_eq!(percent_decode("p%26ss%3Dw%25rd"), "p&ss=w%rd");
        assert_eq!(percent_decode("plain"), "plain");
        assert_eq!(percent_decode("bad%zz%4"), "bad%zz%4");
    }

    #[test]
    fn urls_lose_their_secrets_but_keep_the_rest() {
        assert_eq!(
            redact_url("kafka://a:1,b:2?sasl.password.file=/run/pw&ssl.key.password=x"),
            "kafka://a:1,b:2?sasl.password.file=/run/pw&ssl.key.password=***"
        );
        assert_eq!(redact_url("nats://s3cr3t@h:4222"), "nats://***@h:4222");
        assert_eq!(redact_url("memory://orders"), "memory://orders");
    }
}

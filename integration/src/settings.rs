//! Connection settings for tests and benchmarks: `brokers.env` at the repository root is
//! the one place for them; an environment variable of the same name wins.

/// The contents of `brokers.env`, compiled in so tests run from any directory.
const BROKERS_ENV: &str = include_str!("../../brokers.env");

/// The value of `key`: the environment first, then `brokers.env`.
///
/// # Panics
/// When `key` is in neither — a typo in a test, not a runtime condition.
pub fn get(key: &str) -> String {
    if let Ok(v) = std::env::var(key)
        && !v.is_empty()
    {
        return v;
    }
    file_value(key).unwrap_or_else(|| panic!("`{key}` is neither set nor in brokers.env"))
}

/// The value `brokers.env` gives `key`, ignoring the environment.
pub fn file_value(key: &str) -> Option<String> {
    BROKERS_ENV
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.trim().to_owned())
}

/// The value after `name` on the command line (`--messages 5000`), for the benchmark
/// binaries.
pub fn arg(name: &str) -> Option<String> {
    let mut args = std::env::args();
    while let Some(a) = args.next() {
        if a == name {
            return args.next();
        }
    }
    None
}

/// The `host:port` part of a URL such as `kafka://127.0.0.1:9092` or
/// `sqs://127.0.0.1:4566?region=us-east-1`.
pub fn authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest)
}

/// `url` with its host list replaced by `hosts` (credentials, path and query kept).
pub fn with_hosts(url: &str, hosts: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let credentials = authority.rsplit_once('@').map_or("", |(c, _)| c);
    let at = if credentials.is_empty() { "" } else { "@" };
    format!("{scheme}://{credentials}{at}{hosts}{tail}")
}

/// A query parameter of a URL.
pub fn query_param(url: &str, name: &str) -> Option<String> {
    let query = url.split_once('?')?.1;
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_file_and_parses_urls() {
        assert_eq!(file_value("RABBITMQ_PORT").as_deref(), Some("5672"));
        assert_eq!(authority("kafka://127.0.0.1:9092"), "127.0.0.1:9092");
        assert_eq!(
            authority("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "127.0.0.1:5672"
        );
        assert_eq!(
            authority("sqs://127.0.0.1:4566?region=us-east-1"),
            "127.0.0.1:4566"
        );
        assert_eq!(
            query_param("sqs://h:1?region=us-east-1", "region").as_deref(),
            Some("us-east-1")
        );
    }

    #[test]
    fn hosts_are_replaced_and_the_rest_kept() {
        assert_eq!(
            with_hosts("amqp://guest:guest@h1:1,h2:2/%2f", "p:9,q:8"),
            "amqp://guest:guest@p:9,q:8/%2f"
        );
        assert_eq!(
            with_hosts("kafka://h1:1,h2:2?reliq.replication=3", "p:9"),
            "kafka://p:9?reliq.replication=3"
        );
        assert_eq!(with_hosts("nats://h:1", "p:9"), "nats://p:9");
    }
}

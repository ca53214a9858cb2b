//! Packet loss on loopback links, for the chaos tests: an nftables table that drops a
//! share of the TCP packets to and from some local ports — the listening ports of the
//! [`FaultProxy`](crate::proxy::FaultProxy)s between the consumer and the cluster nodes,
//! so only the consumer's links are lossy while the nodes still reach each other.
//!
//! Dropped packets are the kernel's, not the proxy's: TCP retransmits them (after its
//! retransmission timeout, 200 ms and doubling on loopback), so the peers see a slow,
//! stuttering link — requests and answers late, some past the clients' timeouts — and
//! never a corrupted or reordered stream. That is the ambiguous case: a broker that
//! committed what the client gave up on.
//!
//! Needs root and `nft` (Debian's `nftables`; `just chaos` installs it). Each loss is
//! its own table (`inet reliq_loss_<pid>_<n>`), deleted by [`PacketLoss::stop`] or, at
//! the latest, when the value is dropped.

use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, ensure};

/// Tables made by this process, numbered so several losses can coexist.
static TABLES: AtomicU32 = AtomicU32::new(0);

/// Packets seen and dropped on the lossy ports so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LossCounts {
    /// TCP packets to or from the ports (the dropped ones included).
    pub seen: u64,
    /// Of them, dropped.
    pub dropped: u64,
}

/// A running loss (removed when dropped).
#[derive(Debug)]
pub struct PacketLoss {
    table: String,
    removed: bool,
}

impl PacketLoss {
    /// Drop `percent` % of the TCP packets to or from `ports` on this host, each packet
    /// drawn at random, from now until [`stop`](Self::stop).
    pub fn start(ports: &[u16], percent: u8) -> anyhow::Result<Self> {
        ensure!(!ports.is_empty(), "packet loss: no ports");
        ensure!(
            (1..=100).contains(&percent),
            "packet loss: {percent} % is not in 1..=100"
        );
        let table = format!(
            "reliq_loss_{}_{}",
            std::process::id(),
            TABLES.fetch_add(1, Ordering::SeqCst)
        );
        let ports = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        // Loopback packets pass the input hook once each way: to a port (client → proxy)
        // and from it (proxy → client). The first rule only counts, the second drops.
        let ruleset = format!(
            "table inet {table} {{
                set ports {{ type inet_service; elements = {{ {ports} }} }}
                chain input {{
                    type filter hook input priority filter; policy accept;
                    tcp dport @ports counter
                    tcp sport @ports counter
                    tcp dport @ports numgen random mod 100 < {percent} counter drop
                    tcp sport @ports numgen random mod 100 < {percent} counter drop
                }}
            }}"
        );
        nft(&["-f", "-"], Some(&ruleset))
            .context("installing the packet-loss rules (needs root and nftables)")?;
        Ok(Self {
            table,
            removed: false,
        })
    }

    /// Packets seen and dropped so far.
    pub fn counts(&self) -> anyhow::Result<LossCounts> {
        let listing = nft(&["list", "table", "inet", &self.table], None)?;
        let counters: Vec<u64> = listing
            .lines()
            .filter_map(|line| {
                let (_, after) = line.split_once("counter packets ")?;
                after.split_whitespace().next()?.parse().ok()
            })
            .collect();
        match counters.as_slice() {
            [to, from, dropped_to, dropped_from] => Ok(LossCounts {
                seen: to + from,
                dropped: dropped_to + dropped_from,
            }),
            other => anyhow::bail!(
                "packet loss: expected 4 counters in table {}, read {other:?}:\n{listing}",
                self.table
            ),
        }
    }

    /// Remove the loss; returns what it did.
    pub fn stop(mut self) -> anyhow::Result<LossCounts> {
        let counts = self.counts();
        nft(&["delete", "table", "inet", &self.table], None)?;
        self.removed = true;
        counts
    }
}

impl Drop for PacketLoss {
    fn drop(&mut self) {
        if !self.removed
            && let Err(e) = nft(&["delete", "table", "inet", &self.table], None)
        {
            tracing::error!(table = %self.table, error = %e, "packet loss: removing the nftables table failed; remove it with `nft delete table inet {}`", self.table);
        }
    }
}

/// `nft ARGS…` with `stdin`, its stdout.
fn nft(args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("nft")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft (Debian package nftables)")?;
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .context("nft stdin")?
            .write_all(input.as_bytes())?;
    }
    drop(child.stdin.take());
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "nft {args:?}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

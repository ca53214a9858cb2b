//! What a round measures and how it is reported: [`Rate`], the CPU clocks, the median,
//! [`Series`] and the handler-call timeline.

use std::future::Future;
use std::time::{Duration, Instant};

/// One side's measurement: messages per second (wall clock) and the process's CPU time
/// per message (user + system, every thread — the client library's I/O threads too).
/// The CPU figure is the steadier one on a shared machine: it does not depend on how
/// long the broker took to answer.
#[derive(Clone, Copy, Debug)]
pub struct Rate {
    pub per_sec: f64,
    pub cpu_us: f64,
}

impl Rate {
    /// The rate of messages handled in two deliveries each, from the rate of deliveries.
    pub fn per_message_of_two(self) -> Self {
        Self {
            per_sec: self.per_sec / 2.0,
            cpu_us: self.cpu_us * 2.0,
        }
    }

    /// `n` messages from `t0` (wall) and `cpu0` (CPU) to now.
    pub fn since(n: usize, t0: Instant, cpu0: Duration) -> Self {
        Self {
            per_sec: n as f64 / t0.elapsed().as_secs_f64(),
            cpu_us: (cpu_time() - cpu0).as_secs_f64() * 1e6 / n as f64,
        }
    }
}

/// CPU time per thread of this process so far (`/proc/self/task/*/schedstat`), keyed by
/// thread id, with the thread's name: with `--timeline-ms`, which threads spent a
/// round's CPU.
pub fn thread_cpu() -> std::collections::BTreeMap<u64, (String, Duration)> {
    let mut threads = std::collections::BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return threads;
    };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let read = |file: &str| std::fs::read_to_string(task.path().join(file)).ok();
        let ran = read("schedstat")
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .map(Duration::from_nanos);
        if let (Some(name), Some(ran)) = (read("comm"), ran) {
            threads.insert(tid, (name.trim().to_owned(), ran));
        }
    }
    threads
}

/// The threads that ran between two [`thread_cpu`] readings, most CPU first, grouped by
/// name (with how many threads of that name ran).
pub fn print_thread_cpu(before: &std::collections::BTreeMap<u64, (String, Duration)>, n: usize) {
    let mut by_name = std::collections::BTreeMap::<String, (Duration, usize)>::new();
    for (tid, (name, ran)) in thread_cpu() {
        let start = before.get(&tid).map_or(Duration::ZERO, |(_, r)| *r);
        let spent = ran.saturating_sub(start);
        if !spent.is_zero() {
            let entry = by_name.entry(name).or_default();
            entry.0 += spent;
            entry.1 += 1;
        }
    }
    let mut rows: Vec<_> = by_name.into_iter().collect();
    rows.sort_by_key(|(_, (spent, _))| std::cmp::Reverse(*spent));
    println!("  CPU per message by thread name (threads):");
    for (name, (spent, count)) in rows {
        println!(
            "    {name:<20} {:>6.1} µs ({count})",
            spent.as_secs_f64() * 1e6 / n as f64
        );
    }
}

/// CPU time (user + system) this process has used so far.
pub fn cpu_time() -> Duration {
    // SAFETY: `getrusage` only writes the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let micros = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    micros(usage.ru_utime) + micros(usage.ru_stime)
}

/// The median of `xs` (sorted in place).
pub fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let mid = xs.len() / 2;
    if xs.len().is_multiple_of(2) {
        (xs[mid - 1] + xs[mid]) / 2.0
    } else {
        xs[mid]
    }
}

/// One measurement per side and round; reported as median (min–max).
#[derive(Default)]
pub struct Series {
    pub reliq: Vec<Rate>,
    pub raw: Vec<Rate>,
    /// Kafka: the raw consumer that also reads each record's message id (see
    /// `raw_kafka::consume`), reported on a second line.
    pub raw_reading_id: Vec<Rate>,
    /// RabbitMQ, NATS and SQS: the fastest safe raw consume (`consume_fast`), beside the
    /// plain idiom: "vs the limit".
    pub raw_limit: Vec<Rate>,
}

impl Series {
    /// One round of both sides, in the order given.
    pub async fn measure(
        &mut self,
        reliq_first: bool,
        reliq: impl Future<Output = anyhow::Result<Rate>>,
        raw: impl Future<Output = anyhow::Result<Rate>>,
    ) -> anyhow::Result<()> {
        if reliq_first {
            self.reliq.push(reliq.await?);
            self.raw.push(raw.await?);
        } else {
            self.raw.push(raw.await?);
            self.reliq.push(reliq.await?);
        }
        Ok(())
    }

    pub fn line(&self, what: &str) -> String {
        let range = |xs: &[f64]| {
            let (lo, hi) = xs
                .iter()
                .fold((f64::MAX, 0.0f64), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
            format!("{lo:.0}–{hi:.0}")
        };
        let rates = |side: &[Rate]| side.iter().map(|r| r.per_sec).collect::<Vec<_>>();
        let cpus = |side: &[Rate]| side.iter().map(|r| r.cpu_us).collect::<Vec<_>>();
        let (mut reliq, mut raw) = (rates(&self.reliq), rates(&self.raw));
        let (mut reliq_cpu, mut raw_cpu) = (cpus(&self.reliq), cpus(&self.raw));
        let (reliq_median, raw_median) = (median(&mut reliq), median(&mut raw));
        let reliq_cpu = median(&mut reliq_cpu);
        let mut line = format!(
            "  {what:<20} reliq {:>9.0} msg/s ({}) | raw {:>9.0} msg/s ({}) | ratio of medians {:.2}\n  {:<20} CPU per message: reliq {:.1} µs | raw {:.1} µs (medians)",
            reliq_median,
            range(&reliq),
            raw_median,
            range(&raw),
            reliq_median / raw_median,
            "",
            reliq_cpu,
            median(&mut raw_cpu),
        );
        // The second raw consumers, each beside the same reliq median.
        for (what, side) in [
            ("raw, fastest safe loop", &self.raw_limit),
            ("raw reading the id", &self.raw_reading_id),
        ] {
            if side.is_empty() {
                continue;
            }
            let mut other = rates(side);
            let other_median = median(&mut other);
            line += &format!(
                "\n  {:<20} {what} {:>9.0} msg/s ({}) | ratio of medians {:.2} | CPU {:.1} µs",
                "",
                other_median,
                range(&other),
                reliq_median / other_median,
                median(&mut cpus(side)),
            );
        }
        line
    }
}

/// Handler calls per `bucket` since `t0`, by attempt: one line per bucket with any.
pub fn print_timeline(t0: Instant, bucket: Duration, calls: &[(Instant, u32)]) {
    let mut rows = std::collections::BTreeMap::<u128, [usize; 3]>::new();
    for (at, attempt) in calls {
        let slot = at.duration_since(t0).as_millis() / bucket.as_millis().max(1);
        rows.entry(slot).or_default()[(*attempt as usize).clamp(1, 3) - 1] += 1;
    }
    println!(
        "  timeline ({} ms buckets): from ms: attempt 1, 2, 3+",
        bucket.as_millis()
    );
    for (slot, [a1, a2, a3]) in rows {
        println!(
            "    {:>6}: {a1:>6} {a2:>6} {a3:>6}",
            slot * bucket.as_millis()
        );
    }
}

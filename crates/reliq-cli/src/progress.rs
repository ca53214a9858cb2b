//! Progress of a replay or purge: a bar with rate and ETA on a terminal, a plain line
//! every few seconds otherwise (a CI log, a file) — always on stderr, so `--json` stays
//! clean on stdout.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use reliq::Progress;

/// How often a plain progress line is written.
const PLAIN_EVERY: Duration = Duration::from_secs(2);

pub(crate) enum Reporter {
    Bar(ProgressBar),
    Plain {
        operation: &'static str,
        total: Option<u64>,
        started: Instant,
        last: Arc<Mutex<Instant>>,
    },
}

/// Whether progress is drawn as a bar (stderr is a terminal and the answer is not JSON).
pub(crate) fn draws_a_bar(json: bool) -> bool {
    std::io::stderr().is_terminal() && !json
}

impl Reporter {
    /// `total` is the DLQ's size when known (the bar counts entries read against it).
    pub(crate) fn start(operation: &'static str, total: Option<u64>, json: bool) -> Self {
        if draws_a_bar(json) {
            let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{prefix} [{bar:30}] {pos}/{len} read · {msg} · {per_sec} · ETA {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar.set_prefix(operation);
            Self::Bar(bar)
        } else {
            Self::Plain {
                operation,
                total,
                started: Instant::now(),
                last: Arc::new(Mutex::new(Instant::now())),
            }
        }
    }

    /// The engine's progress callback.
    pub(crate) fn callback(&self) -> impl Fn(&Progress) + Send + Sync + 'static {
        let sink: Box<dyn Fn(&Progress) + Send + Sync> = match self {
            Self::Bar(bar) => {
                let bar = bar.clone();
                Box::new(move |p: &Progress| {
                    bar.set_position(p.scanned as u64);
                    bar.set_message(format!(
                        "{} matched, {} done, {} failed",
                        p.matched, p.done, p.failed
                    ));
                })
            }
            Self::Plain {
                operation,
                total,
                started,
                last,
            } => {
                let (operation, total, started, last) =
                    (*operation, *total, *started, last.clone());
                Box::new(move |p: &Progress| {
                    let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
                    if last.elapsed() < PLAIN_EVERY {
                        return;
                    }
                    *last = Instant::now();
                    let secs = started.elapsed().as_secs_f64().max(0.001);
                    let of = total.map(|t| format!("/{t}")).unwrap_or_default();
                    eprintln!(
                        "{operation}: {}{of} read, {} matched, {} done, {} failed, {:.0}/s",
                        p.scanned,
                        p.matched,
                        p.done,
                        p.failed,
                        p.done as f64 / secs
                    );
                })
            }
        };
        move |p: &Progress| sink(p)
    }

    pub(crate) fn finish(&self) {
        if let Self::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

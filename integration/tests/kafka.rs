//! Kafka-specific behaviour beyond the portable suite, on the real broker.

use std::time::Duration;

use anyhow::ensure;
use reliq_conformance::support::{Recorder, wait_until};
use reliq_conformance::{Backend, Ctx};
use reliq_core::{BoxError, Delivery, Message, RetryPolicy, Transient};
use reliq_integration::kafka::KafkaBackend;

mod kafka {
    use super::*;

    /// A 5 s tier: the relay holds the retry topic's partition paused until the record is
    /// due, and hands it out within 1 s after that; meanwhile the source keeps flowing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn five_second_tier_is_observed_within_one_second() -> anyhow::Result<()> {
        let backend = KafkaBackend::new();
        let ctx = Ctx::new(&backend, "tier-5s").await?;
        let rec = Recorder::new();
        let r = rec.clone();
        let tier = Duration::from_secs(5);
        let h = ctx
            .consumer("c")
            .retry(RetryPolicy::tiers([tier]).max_attempts(2))
            .start(move |d: Delivery| {
                let r = r.clone();
                async move {
                    r.call(&d);
                    if d.payload() == b"flaky" && d.attempt() == 1 {
                        return Err(Transient::msg("downstream 503").into());
                    }
                    r.effect(d.id());
                    Ok::<(), BoxError>(())
                }
            })
            .await?;
        let flaky = Message::new("flaky");
        let id = flaky.id().clone();
        ctx.publish(flaky).await?;
        wait_until("first attempt", Duration::from_secs(30), || {
            rec.calls_for(&id).len() == 1
        })
        .await?;
        // While the retry waits, new records on the source are processed.
        ctx.publish_all((0..20).map(|i| Message::new(format!("ok-{i}"))).collect())
            .await?;
        wait_until("20 later records", Duration::from_secs(4), || {
            rec.effect_count() == 20
        })
        .await?;
        ensure!(rec.calls_for(&id).len() == 1, "the retry came back early");
        wait_until("retried", Duration::from_secs(30), || {
            rec.calls_for(&id).len() == 2
        })
        .await?;
        let calls = rec.calls_for(&id);
        let waited = calls[1].at - calls[0].at;
        ensure!(
            waited >= tier,
            "retried after {waited:?}, before the 5 s tier"
        );
        ensure!(
            waited <= tier + Duration::from_secs(1),
            "retried after {waited:?}, more than 1 s late"
        );
        ensure!(calls[1].attempt == 2);
        let s = h.shutdown().await.stats;
        ensure!(
            s.retried == 1 && s.processed == 21 && s.dead_lettered == 0,
            "{s:?}"
        );
        ensure!(backend.name() == "kafka");
        Ok(())
    }
}

//! Records in batches, straight from librdkafka.
//!
//! Each consumer routes its partitions' fetched records to a queue of its own (a
//! [`FetchQueue`]), which its poll thread drains with `rd_kafka_consume_batch_queue`: up
//! to a pass's worth of records in one call, under one queue lock and one clock read.
//! Rebalances, errors and commit results stay on the consumer's own queue, served by
//! `BaseConsumer::poll` as before. rdkafka's `poll` hands out one record per call — a
//! queue lock, several clock reads and an `Arc` allocation each — which at a million
//! records a second was most of a poll thread's time.
//!
//! This module holds the crate's `unsafe` code (librdkafka's C API); each block says
//! what keeps it sound.
#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rdkafka::bindings as rd;
use rdkafka::message::{BorrowedMessage, Headers as _, Message};
use reliq_core::seam::RawMessage;

use crate::codec::RecordView;

/// Most records the poll thread takes from librdkafka in one pass, between two looks at
/// the buffer bound.
pub(super) const POLL_BATCH: usize = 256;

/// A record taken from a [`FetchQueue`]; owned, returned to librdkafka on drop.
///
/// It refers to its consumer's internals: it must be dropped before that consumer is
/// destroyed (librdkafka's rule; see `ConsumerHandle` in the receiver for how records
/// keep their consumer alive).
pub(crate) struct Fetched(NonNull<rd::rd_kafka_message_t>);

// SAFETY: a librdkafka message may be used and destroyed from any thread, one at a
// time; it is destroyed once, on drop. Not `Sync`: reading the headers parses and caches
// them in the message, a write behind `&self`.
unsafe impl Send for Fetched {}

impl Drop for Fetched {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `rd_kafka_consume_batch_queue` and is destroyed
        // exactly once, here.
        unsafe { rd::rd_kafka_message_destroy(self.0.as_ptr()) }
    }
}

impl Fetched {
    fn raw(&self) -> &rd::rd_kafka_message_t {
        // SAFETY: valid until drop (see the type's docs).
        unsafe { self.0.as_ref() }
    }

    /// A consumer error librdkafka reports in place of a record (e.g. offset out of
    /// range), as text.
    pub(crate) fn error(&self) -> Option<String> {
        if self.raw().err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            return None;
        }
        // SAFETY: returns a static or message-owned NUL-terminated string.
        let text = unsafe { CStr::from_ptr(rd::rd_kafka_message_errstr(self.0.as_ptr())) };
        Some(text.to_string_lossy().into_owned())
    }
}

/// What a [`LazyRecord`] decodes with, and keeps alive: the record's consumer.
pub(crate) trait RecordOwner: Send + Sync + 'static {
    /// The record as a message (id, key, payload copy, headers).
    fn decode(&self, record: &Fetched) -> reliq_core::Message;
}

/// A delivery's message, decoded only when something reads more than its payload or key
/// ([`RawMessage`]): librdkafka parses a record's headers — the message id's among them —
/// only when asked, and that parse (a zeroed buffer, a list and a header allocated per
/// record) was most of a record's cost in the runtime. A handler that reads only the
/// payload never pays it.
///
/// Holds its consumer (`owner`) until it is dropped, so the record never outlives it.
pub(crate) struct LazyRecord<O: RecordOwner> {
    // Declared first: the record goes back to librdkafka before its consumer can go.
    record: Fetched,
    decoded: OnceLock<reliq_core::Message>,
    owner: Arc<O>,
}

// SAFETY: shared access reads the record's payload and key, which librdkafka never
// writes after handing the record out; the one write behind `&self` — the header parse
// cached in the record — happens only inside `decoded.get_or_init`, which runs one
// initializer at a time (others wait for it), and `record` is private to this module.
unsafe impl<O: RecordOwner> Sync for LazyRecord<O> {}

impl<O: RecordOwner> LazyRecord<O> {
    pub(crate) fn new(record: Fetched, owner: Arc<O>) -> Self {
        Self {
            record,
            decoded: OnceLock::new(),
            owner,
        }
    }
}

impl<O: RecordOwner> RawMessage for LazyRecord<O> {
    fn payload(&self) -> &[u8] {
        RecordView::payload(&self.record).unwrap_or_default()
    }

    fn key(&self) -> Option<&[u8]> {
        RecordView::key(&self.record)
    }

    fn message(&self) -> &reliq_core::Message {
        self.decoded.get_or_init(|| self.owner.decode(&self.record))
    }
}

/// A record as the poll thread reads it: a [`Fetched`] (every record, normally) or a
/// record `BaseConsumer::poll` returned (one fetched before its partition was routed to
/// the fetch queue).
pub(crate) trait KafkaRecord: RecordView + Sized {
    /// The owned record, to be decoded later (off the poll thread), or back if it
    /// borrows its consumer and must be decoded now.
    fn into_fetched(self) -> Result<Fetched, Self>;
}

impl KafkaRecord for Fetched {
    fn into_fetched(self) -> Result<Fetched, Self> {
        Ok(self)
    }
}

impl KafkaRecord for BorrowedMessage<'_> {
    fn into_fetched(self) -> Result<Fetched, Self> {
        Err(self)
    }
}

impl RecordView for Fetched {
    fn partition(&self) -> i32 {
        self.raw().partition
    }

    fn offset(&self) -> i64 {
        self.raw().offset
    }

    fn payload(&self) -> Option<&[u8]> {
        let m = self.raw();
        // SAFETY: librdkafka's (pointer, length) of a buffer the message keeps alive.
        (!m.payload.is_null()).then(|| unsafe {
            std::slice::from_raw_parts(m.payload.cast::<u8>().cast_const(), m.len)
        })
    }

    fn key(&self) -> Option<&[u8]> {
        let m = self.raw();
        // SAFETY: as for the payload.
        (!m.key.is_null()).then(|| unsafe {
            std::slice::from_raw_parts(m.key.cast::<u8>().cast_const(), m.key_len)
        })
    }

    fn timestamp_ms(&self) -> Option<i64> {
        let mut kind = rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE;
        // SAFETY: reads the message; `kind` is a valid out-pointer.
        let ts = unsafe { rd::rd_kafka_message_timestamp(self.0.as_ptr(), &mut kind) };
        (ts != -1 && kind != rd::rd_kafka_timestamp_type_t::RD_KAFKA_TIMESTAMP_NOT_AVAILABLE)
            .then_some(ts)
    }

    /// A name that is not UTF-8 is passed with its invalid bytes replaced.
    fn headers(&self, mut f: impl FnMut(&str, Option<&[u8]>)) {
        let mut hdrs: *mut rd::rd_kafka_headers_t = std::ptr::null_mut();
        // SAFETY: `hdrs` is a valid out-pointer; the list belongs to the message.
        let err = unsafe { rd::rd_kafka_message_headers(self.0.as_ptr(), &mut hdrs) };
        if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || hdrs.is_null() {
            return;
        }
        for idx in 0.. {
            let mut name: *const std::ffi::c_char = std::ptr::null();
            let mut value: *const std::ffi::c_void = std::ptr::null();
            let mut size = 0usize;
            // SAFETY: valid out-pointers; a non-error return sets them to the header's
            // NUL-terminated name and (value, size), owned by the list.
            let err =
                unsafe { rd::rd_kafka_header_get_all(hdrs, idx, &mut name, &mut value, &mut size) };
            if err != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
                return;
            }
            // SAFETY: as above; both live as long as the message.
            let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
            let value = (!value.is_null())
                .then(|| unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) });
            f(&name, value);
        }
    }
}

impl RecordView for BorrowedMessage<'_> {
    fn partition(&self) -> i32 {
        Message::partition(self)
    }
    fn offset(&self) -> i64 {
        Message::offset(self)
    }
    fn payload(&self) -> Option<&[u8]> {
        Message::payload(self)
    }
    fn key(&self) -> Option<&[u8]> {
        Message::key(self)
    }
    fn timestamp_ms(&self) -> Option<i64> {
        Message::timestamp(self).to_millis()
    }
    fn headers(&self, mut f: impl FnMut(&str, Option<&[u8]>)) {
        if let Some(raw) = Message::headers(self) {
            for h in raw.iter() {
                f(h.key, h.value);
            }
        }
    }
}

/// One consumer's queue of fetched records (see the module docs), plus a handle on the
/// consumer's event queue to know when it has something to serve.
pub(crate) struct FetchQueue {
    rk: NonNull<rd::rd_kafka_t>,
    records: NonNull<rd::rd_kafka_queue_t>,
    /// `None` for a consumer without a group queue (then events are polled every pass).
    events: Option<NonNull<rd::rd_kafka_queue_t>>,
}

// SAFETY: librdkafka's handle and queues are thread-safe; the queue handles are
// destroyed once, on drop, which the owner runs before the consumer is dropped.
unsafe impl Send for FetchQueue {}
unsafe impl Sync for FetchQueue {}

impl FetchQueue {
    /// # Safety
    /// `rk` is a live consumer handle that outlives the returned queue.
    pub(crate) unsafe fn new(rk: *mut rd::rd_kafka_t) -> Option<Self> {
        let rk = NonNull::new(rk)?;
        // SAFETY: `rk` is live (the caller's promise).
        let records = NonNull::new(unsafe { rd::rd_kafka_queue_new(rk.as_ptr()) })?;
        let events = NonNull::new(unsafe { rd::rd_kafka_queue_get_consumer(rk.as_ptr()) });
        Some(Self {
            rk,
            records,
            events,
        })
    }

    /// Route `partition` of `topic`'s fetched records to this queue. Call before the
    /// partition's fetch starts (before `assign`): librdkafka then keeps the route when
    /// the fetch starts, and drops it when the fetch stops (revoke, unassign).
    pub(crate) fn route(&self, topic: &str, partition: i32) {
        let Ok(topic) = CString::new(topic) else {
            return;
        };
        // SAFETY: `rk` is live (see `new`); the partition handle is released right after
        // the forward, which keeps its own reference to this queue.
        unsafe {
            let pq = rd::rd_kafka_queue_get_partition(self.rk.as_ptr(), topic.as_ptr(), partition);
            if !pq.is_null() {
                rd::rd_kafka_queue_forward(pq, self.records.as_ptr());
                rd::rd_kafka_queue_destroy(pq);
            }
        }
    }

    /// Move up to `max` records into `into`, waiting up to `wait` for the first.
    pub(crate) fn take(&self, wait: Duration, max: usize, into: &mut Vec<Fetched>) {
        let mut raw: [*mut rd::rd_kafka_message_t; POLL_BATCH] = [std::ptr::null_mut(); POLL_BATCH];
        let max = max.clamp(1, raw.len());
        let wait_ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: `raw` has room for `max` pointers; librdkafka fills the first `n`.
        let n = unsafe {
            rd::rd_kafka_consume_batch_queue(self.records.as_ptr(), wait_ms, raw.as_mut_ptr(), max)
        };
        let n = usize::try_from(n).unwrap_or(0).min(max);
        into.extend(
            raw[..n]
                .iter()
                .filter_map(|p| NonNull::new(*p))
                .map(Fetched),
        );
    }

    /// The consumer's event queue may hold something to serve.
    pub(crate) fn events_waiting(&self) -> bool {
        // SAFETY: a live queue handle (see `new`).
        self.events
            .is_none_or(|q| unsafe { rd::rd_kafka_queue_length(q.as_ptr()) } > 0)
    }
}

impl Drop for FetchQueue {
    fn drop(&mut self) {
        // SAFETY: handles from `new`, destroyed once; records still in the queue are
        // discarded (uncommitted: the partition's next owner reads them again).
        unsafe {
            if let Some(q) = self.events {
                rd::rd_kafka_queue_destroy(q.as_ptr());
            }
            rd::rd_kafka_queue_destroy(self.records.as_ptr());
        }
    }
}

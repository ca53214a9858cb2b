-- reliq's inbox and outbox (reliq-sqlite). Applied by `reliq_sqlite::migrate`, which
-- records it in `_reliq_migrations`, not in the application's `_sqlx_migrations`.
-- Times are Unix milliseconds (INTEGER).

-- Inbox: one row per (consumer, message id) whose effect was committed.
-- `pending_until` is NULL for a committed claim (the transactional style); the
-- runtime-driven `Inbox` trait writes a claim with a lease there until `complete`.
CREATE TABLE reliq_inbox (
    consumer      TEXT    NOT NULL,
    message_id    TEXT    NOT NULL,
    claimed_at    INTEGER NOT NULL,
    pending_until INTEGER,
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;
CREATE INDEX reliq_inbox_claimed_at ON reliq_inbox (claimed_at);

-- Outbox: one row per message to publish, in enqueue order (`seq`).
CREATE TABLE reliq_outbox (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id   TEXT    NOT NULL UNIQUE,
    topic        TEXT    NOT NULL,
    route        TEXT,
    message_key  TEXT,
    payload      BLOB    NOT NULL,
    headers      TEXT    NOT NULL DEFAULT '[]',  -- JSON array of [name, value]
    created_at   INTEGER NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    last_error   TEXT,
    lease_owner  TEXT,
    leased_until INTEGER,
    sent_at      INTEGER
);
-- What a relay scans: unsent rows in order.
CREATE INDEX reliq_outbox_unsent ON reliq_outbox (seq) WHERE sent_at IS NULL;
CREATE INDEX reliq_outbox_sent_at ON reliq_outbox (sent_at) WHERE sent_at IS NOT NULL;

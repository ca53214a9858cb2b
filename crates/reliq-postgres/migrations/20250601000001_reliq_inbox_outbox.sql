-- reliq's inbox and outbox (reliq-postgres). Applied by `reliq_postgres::migrate`, which
-- records it in `_reliq_migrations`, not in the application's `_sqlx_migrations`.

-- Inbox: one row per (consumer, message id) whose effect was committed.
-- `pending_until` is NULL for a committed claim (the transactional style); the
-- runtime-driven `Inbox` trait writes a claim with a lease there until `complete`.
CREATE TABLE reliq_inbox (
    consumer      TEXT        NOT NULL,
    message_id    TEXT        NOT NULL,
    claimed_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    pending_until TIMESTAMPTZ,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX reliq_inbox_claimed_at ON reliq_inbox (claimed_at);

-- Outbox: one row per message to publish, in enqueue order (`seq`).
CREATE TABLE reliq_outbox (
    seq          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id   TEXT        NOT NULL UNIQUE,
    topic        TEXT        NOT NULL,
    route        TEXT,
    message_key  TEXT,
    payload      BYTEA       NOT NULL,
    headers      TEXT        NOT NULL DEFAULT '[]',  -- JSON array of [name, value]
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    attempts     INTEGER     NOT NULL DEFAULT 0,
    last_error   TEXT,
    lease_owner  TEXT,
    leased_until TIMESTAMPTZ,
    sent_at      TIMESTAMPTZ
);
-- What a relay scans: unsent rows in order.
CREATE INDEX reliq_outbox_unsent ON reliq_outbox (seq) WHERE sent_at IS NULL;
CREATE INDEX reliq_outbox_sent_at ON reliq_outbox (sent_at) WHERE sent_at IS NOT NULL;

-- Wake idle relays (LISTEN reliq_outbox) when a transaction that enqueued commits.
-- NOTIFY is transactional: nothing is sent for a rolled-back enqueue, and one
-- statement-level notification per transaction is enough.
CREATE FUNCTION reliq_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('reliq_outbox', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER reliq_outbox_notify
    AFTER INSERT ON reliq_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION reliq_outbox_notify();

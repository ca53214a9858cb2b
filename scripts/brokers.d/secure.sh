# scripts/brokers.d/secure.sh - the secured broker set, sourced by scripts/brokers:
#
#   scripts/brokers secure up       a throwaway CA and certificates (openssl), then a
#                                   Kafka KRaft node with TLS and SASL listeners and ACLs
#                                   enforced, beside the plain brokers (idempotent)
#   scripts/brokers secure down     stop it (data and certificates are kept)
#   scripts/brokers secure status   its ports and process; exit 1 when it is down
#   scripts/brokers secure acls ARGS...
#                                   kafka-acls against it, as the super user `admin`
#   scripts/brokers secure nats-user NAME < permissions.json
#                                   the credentials file of a new user of the JWT server's
#                                   account, allowed only the subjects given
#                                   ({"publish": [...], "subscribe": [...]})
#
# Everything lives under DIR/secure: pki/ (the CA, server and client certificates, a
# second "rogue" CA, an expired client certificate), kafka/ and nats-*/ (config, data,
# logs), and nats-auth/ (the NATS JWTs, the credentials file and nkeys, made by the Go
# program scripts/brokers.d/nats-auth with the official nats-io/jwt and nkeys modules).
# Ports and the test credentials are in brokers.env (KAFKA_SECURE_*): they are
# throwaway values for loopback tests, never real secrets.
#
# Kafka's listeners (every principal is `User:<name>`):
#   SASL_SSL        KAFKA_SECURE_SASL_SSL_PORT        SCRAM-SHA-512/256, PLAIN, OAUTHBEARER
#                                                     (the broker's unsecured-JWT validator)
#   MTLS (SSL)      KAFKA_SECURE_MTLS_PORT            client certificate required; the
#                                                     principal is the certificate's CN
#   SASL_PLAINTEXT  KAFKA_SECURE_SASL_PLAINTEXT_PORT  SCRAM-SHA-256/512 without TLS
#   MSKIAM          KAFKA_SECURE_MSK_IAM_PORT         SASL_SSL, OAUTHBEARER validated as AWS
#                                                     MSK IAM does (msk-iam/MskIamValidator.java,
#                                                     compiled here): a SigV4-presigned
#                                                     kafka-cluster:Connect request signed with
#                                                     KAFKA_SECURE_MSK_IAM_KEY; the principal
#                                                     is User:<access key id>
#   CONTROLLER      KAFKA_SECURE_CONTROLLER_PORT      TLS, the broker's own certificate
# StandardAuthorizer with allow.everyone.if.no.acl.found=false: only `admin` (SCRAM, PLAIN,
# OAUTHBEARER sub=admin), the MSK IAM test key and `broker` (the node's certificate) are
# super users; any other
# principal can do what ACLs allow and nothing else.
#
# NATS JetStream servers, TLS only (the test CA), one per way of signing in:
#   nats-users  NATS_SECURE_USERS_PORT   user/password (NATS_SECURE_USER), an nkey user
#   nats-mtls   NATS_SECURE_MTLS_PORT    a client certificate required, plus a token
#   nats-jwt    NATS_SECURE_JWT_PORT     decentralized auth: operator, account, user JWT
#                                        (nats-auth/reliq.creds)
#
# A RabbitMQ node (rabbit-secure@localhost, its own Erlang node beside the plain one),
# TLS only, peer certificates verified against the test CA:
#   AMQPS     RABBITMQ_SECURE_PORT       PLAIN/AMQPLAIN with a password, or EXTERNAL: the
#                                        client certificate's CN is the user
#   HTTPS     RABBITMQ_SECURE_MGMT_PORT  the management API (same certificates)
# Users (definitions loaded at boot; no guest): `admin` (administrator, all of vhost /),
# RABBITMQ_SECURE_USER with a password and KAFKA_SECURE_MTLS_USER (the client
# certificate's CN) without one; neither may do anything until a test grants what
# `reliq topology permissions` prints, on a vhost of its own.
#
# A PostgreSQL cluster (Debian's pg_createcluster, named POSTGRES_SECURE_CLUSTER), TLS
# only on POSTGRES_SECURE_PORT with the node's certificate: plain TCP is rejected; the
# test role and database are the plain cluster's (POSTGRES_USER, POSTGRES_DB).

SDIR=$DIR/secure
PKI=$SDIR/pki
KAFKA_SECURE_SASL_SSL_PORT=${KAFKA_SECURE_SASL_SSL_PORT:-9492}
KAFKA_SECURE_MTLS_PORT=${KAFKA_SECURE_MTLS_PORT:-9493}
KAFKA_SECURE_SASL_PLAINTEXT_PORT=${KAFKA_SECURE_SASL_PLAINTEXT_PORT:-9494}
KAFKA_SECURE_CONTROLLER_PORT=${KAFKA_SECURE_CONTROLLER_PORT:-9495}
KAFKA_SECURE_ADMIN_PASSWORD=${KAFKA_SECURE_ADMIN_PASSWORD:-admin-secret}
KAFKA_SECURE_SCRAM_USER=${KAFKA_SECURE_SCRAM_USER:-reliq-scram}
KAFKA_SECURE_SCRAM_PASSWORD=${KAFKA_SECURE_SCRAM_PASSWORD:-scram-secret}
KAFKA_SECURE_MSK_IAM_PORT=${KAFKA_SECURE_MSK_IAM_PORT:-9496}
KAFKA_SECURE_MSK_IAM_KEY=${KAFKA_SECURE_MSK_IAM_KEY:-AKIARELIQMSKTEST}
KAFKA_SECURE_MSK_IAM_SECRET=${KAFKA_SECURE_MSK_IAM_SECRET:-msk-iam-test-secret}
KAFKA_SECURE_CLUSTER_ID=${KAFKA_SECURE_CLUSTER_ID:-cmVsaXEtc2VjdXJlLWthZmthAA}  # fixed: local test node

NATS_SECURE_USERS_PORT=${NATS_SECURE_USERS_PORT:-4443}
NATS_SECURE_MTLS_PORT=${NATS_SECURE_MTLS_PORT:-4444}
NATS_SECURE_JWT_PORT=${NATS_SECURE_JWT_PORT:-4445}
NATS_SECURE_USER=${NATS_SECURE_USER:-reliq-nats}
NATS_SECURE_PASSWORD=${NATS_SECURE_PASSWORD:-nats-secret}
NATS_SECURE_TOKEN=${NATS_SECURE_TOKEN:-nats-token}
NATS_SECURE_SERVERS="nats-users nats-mtls nats-jwt"

RABBITMQ_SECURE_PORT=${RABBITMQ_SECURE_PORT:-5671}
RABBITMQ_SECURE_MGMT_PORT=${RABBITMQ_SECURE_MGMT_PORT:-15671}
RABBITMQ_SECURE_DIST_PORT=${RABBITMQ_SECURE_DIST_PORT:-25671}
RABBITMQ_SECURE_ADMIN_PASSWORD=${RABBITMQ_SECURE_ADMIN_PASSWORD:-admin-secret}
RABBITMQ_SECURE_USER=${RABBITMQ_SECURE_USER:-reliq-amqp}
RABBITMQ_SECURE_PASSWORD=${RABBITMQ_SECURE_PASSWORD:-amqp-secret}
RABBITMQ_SECURE_NODE=rabbit-secure@localhost

POSTGRES_SECURE_PORT=${POSTGRES_SECURE_PORT:-5433}

secure_ports() { echo "$KAFKA_SECURE_SASL_SSL_PORT $KAFKA_SECURE_MTLS_PORT $KAFKA_SECURE_SASL_PLAINTEXT_PORT $KAFKA_SECURE_MSK_IAM_PORT $KAFKA_SECURE_CONTROLLER_PORT"; }
nats_secure_port() {
  case $1 in
    nats-users) echo "$NATS_SECURE_USERS_PORT" ;;
    nats-mtls) echo "$NATS_SECURE_MTLS_PORT" ;;
    nats-jwt) echo "$NATS_SECURE_JWT_PORT" ;;
  esac
}

# ---------------------------------------------------------------- certificates
# pki_issue NAME CN DAYS EXT [CA]: NAME.key (PKCS#8) + NAME.crt signed by CA (default ca)
pki_issue() {
  local name=$1 cn=$2 days=$3 ext=$4 ca=${5:-ca}
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$name.key" -out "$PKI/$name.csr" \
    -subj "/CN=$cn" 2> /dev/null || return 1
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/$ca.crt" -CAkey "$PKI/$ca.key" \
    -CAcreateserial -out "$PKI/$name.crt" -days "$days" -sha256 \
    -extfile <(printf '%s\n' "$ext") 2> /dev/null || return 1
  rm -f "$PKI/$name.csr"
}

# A CA's own self-signed certificate: NAME.key + NAME.crt
pki_ca() {
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/$1.key" -out "$PKI/$1.crt" \
    -days 3650 -sha256 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2> /dev/null
}

# An already expired client certificate (openssl x509 cannot date backwards: `openssl ca`).
pki_expired() {
  local db=$PKI/ca-db
  mkdir -p "$db" && : > "$db/index.txt" && echo 1000 > "$db/serial"
  cat > "$db/openssl.cnf" << CNF
[ ca ]
default_ca = test
[ test ]
database = $db/index.txt
new_certs_dir = $db
serial = $db/serial
default_md = sha256
policy = any
copy_extensions = none
x509_extensions = client
[ any ]
commonName = supplied
[ client ]
basicConstraints = CA:FALSE
extendedKeyUsage = clientAuth
CNF
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/expired.key" -out "$PKI/expired.csr" \
    -subj "/CN=$KAFKA_SECURE_MTLS_USER" 2> /dev/null &&
  openssl ca -batch -config "$db/openssl.cnf" -cert "$PKI/ca.crt" -keyfile "$PKI/ca.key" \
    -in "$PKI/expired.csr" -out "$PKI/expired.crt" -notext \
    -startdate 20200101000000Z -enddate 20200201000000Z > "$db/ca.log" 2>&1
}

KAFKA_SECURE_MTLS_USER=${KAFKA_SECURE_MTLS_USER:-reliq-mtls}

# Make the PKI once (kept across restarts: tests and clients keep trusting it).
ensure_pki() {
  [ -s "$PKI/.done" ] && return 0
  command -v openssl > /dev/null 2>&1 || apt_install openssl || return 1
  rm -rf "$PKI" && mkdir -p "$PKI" && chmod 700 "$PKI"
  local server="basicConstraints=CA:FALSE
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=IP:127.0.0.1,DNS:localhost" client="basicConstraints=CA:FALSE
extendedKeyUsage=clientAuth"
  pki_ca ca "reliq test CA" &&
  pki_ca rogue-ca "reliq rogue CA" &&
  pki_issue broker broker 3650 "$server" &&
  pki_issue "$KAFKA_SECURE_MTLS_USER" "$KAFKA_SECURE_MTLS_USER" 3650 "$client" &&
  pki_issue admin admin 3650 "$client" &&
  pki_issue rogue "$KAFKA_SECURE_MTLS_USER" 3650 "$client" rogue-ca &&
  pki_expired || { err "secure: making the test PKI failed (openssl)"; return 1; }
  # Kafka's PEM key store: the private key and the certificate in one file.
  cat "$PKI/broker.key" "$PKI/broker.crt" > "$PKI/broker.pem"
  chmod 600 "$PKI"/*.key "$PKI/broker.pem"
  date -u +%FT%TZ > "$PKI/.done"
  log "secure: test PKI in $PKI (ca.crt; broker, admin, $KAFKA_SECURE_MTLS_USER, rogue, expired)"
}

# ---------------------------------------------------------------- Kafka
start_secure_kafka() {
  local d=$SDIR/kafka
  mkdir -p "$d/data" "$d/logs"
  if pid_alive "$d/pid" "$d/server.properties"; then log "secure kafka: already running (pid $(pid_of "$d/pid"))"; return 0; fi
  local p
  for p in $(secure_ports); do
    if port_open "$p"; then err "secure kafka: port $HOST:$p is in use ($(port_owner "$p")); change KAFKA_SECURE_* in brokers.env"; return 1; fi
  done
  build_msk_iam_validator "$d/classes" || return 1
  local scram="org.apache.kafka.common.security.scram.ScramLoginModule required;"
  cat > "$d/server.properties" << PROPS
# generated by scripts/brokers secure: one KRaft node, TLS and SASL only, ACLs enforced
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$KAFKA_SECURE_CONTROLLER_PORT
listeners=SASL_SSL://$HOST:$KAFKA_SECURE_SASL_SSL_PORT,MTLS://$HOST:$KAFKA_SECURE_MTLS_PORT,SASL_PLAINTEXT://$HOST:$KAFKA_SECURE_SASL_PLAINTEXT_PORT,MSKIAM://$HOST:$KAFKA_SECURE_MSK_IAM_PORT,CONTROLLER://$HOST:$KAFKA_SECURE_CONTROLLER_PORT
advertised.listeners=SASL_SSL://$HOST:$KAFKA_SECURE_SASL_SSL_PORT,MTLS://$HOST:$KAFKA_SECURE_MTLS_PORT,SASL_PLAINTEXT://$HOST:$KAFKA_SECURE_SASL_PLAINTEXT_PORT,MSKIAM://$HOST:$KAFKA_SECURE_MSK_IAM_PORT
listener.security.protocol.map=SASL_SSL:SASL_SSL,MTLS:SSL,SASL_PLAINTEXT:SASL_PLAINTEXT,MSKIAM:SASL_SSL,CONTROLLER:SSL
controller.listener.names=CONTROLLER
inter.broker.listener.name=MTLS
log.dirs=$d/data
num.partitions=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
offsets.topic.num.partitions=1
transaction.state.log.num.partitions=1
group.initial.rebalance.delay.ms=0

# TLS: the broker's certificate, and the test CA for clients and for itself
ssl.keystore.type=PEM
ssl.keystore.location=$PKI/broker.pem
ssl.truststore.type=PEM
ssl.truststore.location=$PKI/ca.crt
listener.name.mtls.ssl.client.auth=required
listener.name.controller.ssl.client.auth=required
# a certificate's principal is its CN: User:reliq-mtls, User:broker
ssl.principal.mapping.rules=RULE:^CN=([^,]+).*$/\$1/,DEFAULT

# SASL
listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-512,SCRAM-SHA-256,PLAIN,OAUTHBEARER
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=$scram
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=$scram
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_admin="$KAFKA_SECURE_ADMIN_PASSWORD";
listener.name.sasl_ssl.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required unsecuredLoginStringClaim_sub="admin";
listener.name.sasl_plaintext.sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=$scram
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=$scram
listener.name.mskiam.sasl.enabled.mechanisms=OAUTHBEARER
listener.name.mskiam.oauthbearer.sasl.server.callback.handler.class=MskIamValidator
listener.name.mskiam.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required unsecuredLoginStringClaim_sub="broker" key_$KAFKA_SECURE_MSK_IAM_KEY="$KAFKA_SECURE_MSK_IAM_SECRET";

# ACLs
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:broker;User:$KAFKA_SECURE_MSK_IAM_KEY
PROPS
  kafka_log4j "$d"
  kafka_tools_log4j
  if [ ! -f "$d/data/meta.properties" ]; then
    java -cp "$KAFKA_LIBS/*" -Dlog4j2.configurationFile="$DIR/kafka/tools-log4j2.properties" \
      kafka.tools.StorageTool format -t "$KAFKA_SECURE_CLUSTER_ID" -c "$d/server.properties" \
      --add-scram "SCRAM-SHA-512=[name=admin,password=$KAFKA_SECURE_ADMIN_PASSWORD]" \
      --add-scram "SCRAM-SHA-256=[name=admin,password=$KAFKA_SECURE_ADMIN_PASSWORD]" \
      --add-scram "SCRAM-SHA-512=[name=$KAFKA_SECURE_SCRAM_USER,password=$KAFKA_SECURE_SCRAM_PASSWORD]" \
      --add-scram "SCRAM-SHA-256=[name=$KAFKA_SECURE_SCRAM_USER,password=$KAFKA_SECURE_SCRAM_PASSWORD]" \
      > "$d/logs/format.log" 2>&1 \
      || { err "secure kafka: StorageTool format failed"; show_logs "$d/logs/format.log"; return 1; }
  fi
  (cd "$d" && exec setsid java -Xms256m "-Xmx$KAFKA_HEAP" -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$d/log4j2.properties" -Dkafka.logs.dir="$d/logs" \
    -cp "$KAFKA_LIBS/*:$d/classes" kafka.Kafka "$d/server.properties" > "$d/logs/kafka.out" 2>&1 < /dev/null) &
  echo $! > "$d/pid"
  log "secure kafka: starting (SASL_SSL $KAFKA_SECURE_SASL_SSL_PORT, mTLS $KAFKA_SECURE_MTLS_PORT, SASL_PLAINTEXT $KAFKA_SECURE_SASL_PLAINTEXT_PORT, MSK IAM $KAFKA_SECURE_MSK_IAM_PORT)"
}

# The MSK IAM stand-in validator, compiled against the broker's jars into CLASSES (again
# when its source changed). javac comes with the JDK, not the JRE the broker needs.
build_msk_iam_validator() { # CLASSES
  local classes=$1 src=$ROOT/scripts/brokers.d/msk-iam/MskIamValidator.java
  [ -f "$classes/MskIamValidator.class" ] && [ "$classes/MskIamValidator.class" -nt "$src" ] && return 0
  command -v javac > /dev/null 2>&1 || apt_install openjdk-17-jdk-headless || return 1
  mkdir -p "$classes"
  run_quiet javac-msk-iam javac -d "$classes" -cp "$KAFKA_LIBS/*" "$src" \
    || { err "secure kafka: could not compile $src"; return 1; }
}

# The admin's client properties for the Kafka CLI tools (SCRAM over TLS).
secure_admin_props() {
  cat > "$SDIR/kafka/admin.properties" << PROPS
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$KAFKA_SECURE_ADMIN_PASSWORD";
ssl.truststore.type=PEM
ssl.truststore.location=$PKI/ca.crt
PROPS
  chmod 600 "$SDIR/kafka/admin.properties"
}

# Ready: every port open, and the admin can list topics over SASL_SSL.
wait_secure_kafka() {
  local d=$SDIR/kafka t0=$SECONDS p out
  for p in $(secure_ports); do
    until port_open "$p"; do
      pid_alive "$d/pid" "$d/server.properties" || { err "secure kafka: exited while starting"; show_logs "$d/logs/kafka.out" "$d/logs/server.log"; return 1; }
      if ((SECONDS - t0 >= WAIT_TIMEOUT)); then err "secure kafka: $HOST:$p not listening within ${WAIT_TIMEOUT}s"; show_logs "$d/logs/server.log"; return 1; fi
      sleep 0.3
    done
  done
  secure_admin_props
  until out=$(timeout 60 "${KAFKA_TOOL[@]}" org.apache.kafka.tools.TopicCommand \
      --bootstrap-server "$HOST:$KAFKA_SECURE_SASL_SSL_PORT" --command-config "$d/admin.properties" --list 2>&1); do
    if ((SECONDS - t0 >= WAIT_TIMEOUT)); then err "secure kafka: the admin cannot list topics: $(tail -n 3 <<< "$out")"; show_logs "$d/logs/server.log"; return 1; fi
    sleep 1
  done
}

stop_secure_kafka() { stop_pid "secure kafka" "$SDIR/kafka/pid" "$SDIR/kafka/server.properties" 60; }

# ---------------------------------------------------------------- NATS
# The Go program that writes the NATS JWTs, built once into DIR/secure/bin.
ensure_nats_auth() {
  local auth=$SDIR/nats-auth bin=$SDIR/bin/nats-auth src=$ROOT/scripts/brokers.d/nats-auth
  if [ ! -x "$bin" ] || [ "$src/main.go" -nt "$bin" ]; then
    command -v go > /dev/null 2>&1 || apt_install golang-go || return 1
    mkdir -p "$SDIR/bin"
    (cd "$src" && run_quiet go-nats-auth go build -o "$bin" .) || return 1
  fi
  [ -s "$auth/.done" ] && [ -s "$auth/account.seed" ] && return 0
  mkdir -p "$auth" && chmod 700 "$auth"
  "$bin" "$auth" || { err "secure nats: nats-auth failed"; return 1; }
  date -u +%FT%TZ > "$auth/.done"
}

start_secure_nats() { # SERVER
  local n=$1 d=$SDIR/$1 port auth
  port=$(nats_secure_port "$n")
  mkdir -p "$d/jetstream"
  if pid_alive "$d/pid" "$d/nats.conf"; then log "secure $n: already running"; return 0; fi
  if port_open "$port"; then err "secure $n: port $HOST:$port is in use ($(port_owner "$port"))"; return 1; fi
  case $n in
    nats-users) auth="tls { cert_file: \"$PKI/broker.crt\", key_file: \"$PKI/broker.key\" }
authorization {
  users = [
    { user: \"$NATS_SECURE_USER\", password: \"$NATS_SECURE_PASSWORD\" }
    { nkey: $(cat "$SDIR/nats-auth/nkey.pub") }
  ]
}" ;;
    nats-mtls) auth="tls { cert_file: \"$PKI/broker.crt\", key_file: \"$PKI/broker.key\", ca_file: \"$PKI/ca.crt\", verify: true }
authorization { token: \"$NATS_SECURE_TOKEN\" }" ;;
    nats-jwt) auth="tls { cert_file: \"$PKI/broker.crt\", key_file: \"$PKI/broker.key\" }
$(cat "$SDIR/nats-auth/resolver.conf")" ;;
  esac
  cat > "$d/nats.conf" << CONF
# generated by scripts/brokers secure
server_name: reliq-secure-$n
listen: $HOST:$port
jetstream { store_dir: "$d/jetstream", max_memory_store: 64MB, max_file_store: 1GB }
$auth
CONF
  (cd "$d" && exec setsid "$NATS_BIN" -c "$d/nats.conf" > "$d/nats.log" 2>&1 < /dev/null) &
  echo $! > "$d/pid"
}

wait_secure_nats() { # SERVER
  local n=$1 d=$SDIR/$1 t0=$SECONDS port
  port=$(nats_secure_port "$n")
  until port_open "$port"; do
    pid_alive "$d/pid" "$d/nats.conf" || { err "secure $n: exited while starting"; show_logs "$d/nats.log"; return 1; }
    if ((SECONDS - t0 >= WAIT_TIMEOUT)); then err "secure $n: $HOST:$port not listening within ${WAIT_TIMEOUT}s"; show_logs "$d/nats.log"; return 1; fi
    sleep 0.2
  done
}

# ---------------------------------------------------------------- RabbitMQ
# RabbitMQ's password hash (rabbit_password_hashing_sha256): base64(salt + sha256(salt + password)).
rabbit_password_hash() {
  python3 -c 'import base64, hashlib, os, sys
salt = os.urandom(4)
print(base64.b64encode(salt + hashlib.sha256(salt + sys.argv[1].encode()).digest()).decode())' "$1"
}

start_secure_rabbitmq() {
  local d=$SDIR/rabbitmq p
  mkdir -p "$d/mnesia" "$d/log"
  if pid_alive "$d/pid" beam.smp; then log "secure rabbitmq: already running (pid $(pid_of "$d/pid"))"; return 0; fi
  for p in $RABBITMQ_SECURE_PORT $RABBITMQ_SECURE_MGMT_PORT $RABBITMQ_SECURE_DIST_PORT; do
    if port_open "$p"; then err "secure rabbitmq: port $HOST:$p is in use ($(port_owner "$p")); change RABBITMQ_SECURE_* in brokers.env"; return 1; fi
  done
  cat > "$d/definitions.json" << JSON
{
  "users": [
    {"name": "admin", "password_hash": "$(rabbit_password_hash "$RABBITMQ_SECURE_ADMIN_PASSWORD")",
     "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ["administrator"]},
    {"name": "$RABBITMQ_SECURE_USER", "password_hash": "$(rabbit_password_hash "$RABBITMQ_SECURE_PASSWORD")",
     "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []},
    {"name": "$KAFKA_SECURE_MTLS_USER", "password_hash": "",
     "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []}
  ],
  "vhosts": [{"name": "/"}],
  "permissions": [{"user": "admin", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}]
}
JSON
  chmod 600 "$d/definitions.json"
  cat > "$d/rabbitmq.conf" << CONF
# generated by scripts/brokers secure: TLS only, certificates verified, no guest
listeners.tcp = none
listeners.ssl.default = $HOST:$RABBITMQ_SECURE_PORT
ssl_options.cacertfile = $PKI/ca.crt
ssl_options.certfile = $PKI/broker.crt
ssl_options.keyfile = $PKI/broker.key
ssl_options.verify = verify_peer
# a certificate is checked when sent; password users may connect without one
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
management.ssl.ip = $HOST
management.ssl.port = $RABBITMQ_SECURE_MGMT_PORT
management.ssl.cacertfile = $PKI/ca.crt
management.ssl.certfile = $PKI/broker.crt
management.ssl.keyfile = $PKI/broker.key
load_definitions = $d/definitions.json
log.console = false
log.file.level = info
CONF
  cat > "$d/advanced.config" << CONF
%% generated by scripts/brokers secure (see rabbit_config)
[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}].
CONF
  echo '[rabbitmq_management,rabbitmq_auth_mechanism_ssl].' > "$d/enabled_plugins"
  : > "$d/rabbitmq-env.conf"
  rm -f "$d/pid"                         # written by the node once it boots
  (rabbit_env "$d" "$RABBITMQ_SECURE_NODE" "$RABBITMQ_SECURE_DIST_PORT" && cd "$d" \
    && exec setsid "$RABBIT_SBIN/rabbitmq-server" > "$d/log/stdout.log" 2>&1 < /dev/null) &
  echo $! > "$d/launcher.pid"
  log "secure rabbitmq: starting (AMQPS $RABBITMQ_SECURE_PORT, HTTPS $RABBITMQ_SECURE_MGMT_PORT)"
}

secure_rabbitmq_alive() { pid_alive "$SDIR/rabbitmq/pid" beam.smp || pid_alive "$SDIR/rabbitmq/launcher.pid" rabbitmq-server; }

# Ready: both ports open and the admin can read the management API over HTTPS.
wait_secure_rabbitmq() {
  local d=$SDIR/rabbitmq t0=$SECONDS p
  for p in $RABBITMQ_SECURE_PORT $RABBITMQ_SECURE_MGMT_PORT; do
    until port_open "$p"; do
      secure_rabbitmq_alive || { err "secure rabbitmq: exited while starting"; show_logs "$d/log/stdout.log" "$d/log/$RABBITMQ_SECURE_NODE.log"; return 1; }
      if ((SECONDS - t0 >= WAIT_TIMEOUT)); then err "secure rabbitmq: $HOST:$p not listening within ${WAIT_TIMEOUT}s"; show_logs "$d/log/$RABBITMQ_SECURE_NODE.log"; return 1; fi
      sleep 0.5
    done
  done
  until curl -fsS --cacert "$PKI/ca.crt" -u "admin:$RABBITMQ_SECURE_ADMIN_PASSWORD" \
      "https://$HOST:$RABBITMQ_SECURE_MGMT_PORT/api/whoami" > /dev/null 2>&1; do
    if ((SECONDS - t0 >= WAIT_TIMEOUT)); then err "secure rabbitmq: the admin cannot reach the management API"; show_logs "$d/log/$RABBITMQ_SECURE_NODE.log"; return 1; fi
    sleep 0.5
  done
}

stop_secure_rabbitmq() {
  local d=$SDIR/rabbitmq
  if pid_alive "$d/pid" beam.smp \
    && (rabbit_env "$d" "$RABBITMQ_SECURE_NODE" "$RABBITMQ_SECURE_DIST_PORT" \
      && exec timeout 60 "$RABBIT_SBIN/rabbitmqctl" -n "$RABBITMQ_SECURE_NODE" stop "$d/pid") > /dev/null 2>&1; then
    log "secure rabbitmq: stopped"
  elif pid_alive "$d/pid" beam.smp; then
    stop_pid "secure rabbitmq" "$d/pid" beam.smp
  fi
  pid_alive "$d/launcher.pid" rabbitmq-server && stop_pid "secure rabbitmq (booting)" "$d/launcher.pid" rabbitmq-server
  rm -f "$d/pid" "$d/launcher.pid"
}

# ---------------------------------------------------------------- PostgreSQL
# A Debian cluster of its own (POSTGRES_SECURE_CLUSTER), TLS only: the node's
# certificate, `hostssl` with scram-sha-256 and every plain TCP connection rejected.
start_secure_postgres() {
  local ver conf status d=$SDIR/postgres
  mkdir -p "$d"
  ver=$(pg_cluster_field 1)
  [ -n "$ver" ] || { err "secure postgres: no PostgreSQL cluster to take the version from (scripts/brokers up first)"; return 1; }
  [ "$(id -u)" = 0 ] || { err "secure postgres: creating and starting a Debian cluster needs root"; return 1; }
  if [ -z "$(pg_cluster_field 1 "$POSTGRES_SECURE_CLUSTER")" ]; then
    run_quiet pg_createcluster-secure pg_createcluster "$ver" "$POSTGRES_SECURE_CLUSTER" -p "$POSTGRES_SECURE_PORT" || return 1
  fi
  ver=$(pg_cluster_field 1 "$POSTGRES_SECURE_CLUSTER") status=$(pg_cluster_field 4 "$POSTGRES_SECURE_CLUSTER")
  conf=/etc/postgresql/$ver/$POSTGRES_SECURE_CLUSTER
  install -o postgres -g postgres -m 600 "$PKI/broker.key" "$conf/server.key"
  install -o postgres -g postgres -m 644 "$PKI/broker.crt" "$conf/server.crt"
  cat > "$conf/conf.d/reliq-secure.conf" << CONF
# generated by scripts/brokers secure
listen_addresses = '$HOST'
port = $POSTGRES_SECURE_PORT
ssl = on
ssl_cert_file = '$conf/server.crt'
ssl_key_file = '$conf/server.key'
CONF
  cat > "$conf/pg_hba.conf" << CONF
# generated by scripts/brokers secure: TLS or nothing over TCP
local     all  postgres                 peer
hostssl   all  all       $HOST/32       scram-sha-256
hostnossl all  all       $HOST/32       reject
CONF
  case $status in
    online*) log "secure postgres: already running"; return 0 ;;
  esac
  if port_open "$POSTGRES_SECURE_PORT"; then err "secure postgres: port $HOST:$POSTGRES_SECURE_PORT is in use ($(port_owner "$POSTGRES_SECURE_PORT"))"; return 1; fi
  pg_ctlcluster --skip-systemctl-redirect "$ver" "$POSTGRES_SECURE_CLUSTER" start > "$d/pg_ctlcluster.log" 2>&1 \
    || { err "secure postgres: pg_ctlcluster start failed"; show_logs "$d/pg_ctlcluster.log"; return 1; }
  log "secure postgres: starting (TLS only, $POSTGRES_SECURE_PORT)"
}

wait_secure_postgres() {
  local t0=$SECONDS d=$SDIR/postgres
  until pg_isready -q -h "$HOST" -p "$POSTGRES_SECURE_PORT"; do
    ((SECONDS - t0 >= WAIT_TIMEOUT)) && { err "secure postgres: pg_isready failed for ${WAIT_TIMEOUT}s"; return 1; }
    sleep 0.3
  done
  pg_setup_role "$POSTGRES_SECURE_PORT" "$d/setup.log" \
    || { err "secure postgres: creating the test role failed"; show_logs "$d/setup.log"; return 1; }
}

stop_secure_postgres() {
  local ver
  ver=$(pg_cluster_field 1 "$POSTGRES_SECURE_CLUSTER")
  [ -n "$ver" ] && [ "$(pg_cluster_field 4 "$POSTGRES_SECURE_CLUSTER")" = online ] || return 0
  pg_ctlcluster --skip-systemctl-redirect "$ver" "$POSTGRES_SECURE_CLUSTER" stop > "$SDIR/postgres/pg_ctlcluster.log" 2>&1 \
    && log "secure postgres: stopped"
}

cmd_secure_up() {
  local t0=$SECONDS
  mkdir -p "$SDIR" "$INSTALL_LOGS" || die "cannot create $SDIR"
  local n
  ensure_kafka || return 1
  ensure_nats || return 1
  ensure_rabbitmq || return 1
  ensure_postgres || return 1
  command -v curl > /dev/null 2>&1 || apt_install curl || return 1
  ensure_pki || return 1
  ensure_nats_auth || return 1
  start_secure_kafka || return 1
  start_secure_rabbitmq || return 1
  start_secure_postgres || return 1
  for n in $NATS_SECURE_SERVERS; do start_secure_nats "$n" || return 1; done
  for n in $NATS_SECURE_SERVERS; do wait_secure_nats "$n" || return 1; done
  wait_secure_kafka || return 1
  wait_secure_rabbitmq || return 1
  wait_secure_postgres || return 1
  log "secure: up in $((SECONDS - t0))s (certificates: $PKI)"
  cmd_secure_status
}

cmd_secure_down() {
  local n
  for n in $NATS_SECURE_SERVERS; do stop_pid "secure $n" "$SDIR/$n/pid" "$SDIR/$n/nats.conf"; done
  stop_secure_rabbitmq
  stop_secure_postgres
  stop_secure_kafka
}

cmd_secure_status() {
  local p closed=() state=up
  for p in $(secure_ports); do port_open "$p" || closed+=("$p"); done
  pid_alive "$SDIR/kafka/pid" "$SDIR/kafka/server.properties" || state=down
  [ "$state" = up ] && [ ${#closed[@]} -gt 0 ] && state=starting
  printf '%-18s %-20s %-8s %s\n' BROKER PORTS STATE NOTE
  printf '%-18s %-20s %-8s %s\n' secure-kafka "$(secure_ports | tr ' ' ,)" "$state" "${closed[*]:+closed: ${closed[*]}}"
  local n p s rc=0
  [ "$state" = up ] || rc=1
  for n in $NATS_SECURE_SERVERS; do
    p=$(nats_secure_port "$n") s=up
    pid_alive "$SDIR/$n/pid" "$SDIR/$n/nats.conf" || s=down
    [ "$s" = up ] && ! port_open "$p" && s=starting
    [ "$s" = up ] || rc=1
    printf '%-18s %-20s %-8s %s\n' "secure-$n" "$p" "$s" ""
  done
  s=up
  pid_alive "$SDIR/rabbitmq/pid" beam.smp || s=down
  if [ "$s" = up ] && ! { port_open "$RABBITMQ_SECURE_PORT" && port_open "$RABBITMQ_SECURE_MGMT_PORT"; }; then s=starting; fi
  [ "$s" = up ] || rc=1
  printf '%-18s %-20s %-8s %s\n' secure-rabbitmq "$RABBITMQ_SECURE_PORT,$RABBITMQ_SECURE_MGMT_PORT" "$s" ""
  s=$(pg_cluster_field 4 "$POSTGRES_SECURE_CLUSTER")
  [ "$s" = online ] && s=up || s=down
  [ "$s" = up ] || rc=1
  printf '%-18s %-20s %-8s %s\n' secure-postgres "$POSTGRES_SECURE_PORT" "$s" ""
  return $rc
}

cmd_secure() {
  local sub=${1:-}
  shift || true
  case $sub in
    up) cmd_secure_up ;;
    down) cmd_secure_down ;;
    status) cmd_secure_status ;;
    acls)
      [ -f "$SDIR/kafka/admin.properties" ] || secure_admin_props
      "${KAFKA_TOOL[@]}" org.apache.kafka.tools.AclCommand \
        --bootstrap-server "$HOST:$KAFKA_SECURE_SASL_SSL_PORT" --command-config "$SDIR/kafka/admin.properties" "$@" ;;
    nats-user)
      [ $# -eq 1 ] || die "usage: $0 secure nats-user NAME < permissions.json"
      ensure_nats_auth > /dev/null || return 1
      "$SDIR/bin/nats-auth" user "$SDIR/nats-auth" "$1" ;;
    *) usage >&2; exit 2 ;;
  esac
}

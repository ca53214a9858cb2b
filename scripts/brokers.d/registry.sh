# scripts/brokers.d/registry.sh - Apicurio Registry as the schema registry (install,
# start, wait, stop); sourced by scripts/brokers (not run).
#
# Apicurio Registry serves the Confluent Schema Registry API (/apis/ccompat/v7: subjects,
# versions, schemas by id, compatibility, config) that reliq-contracts speaks. Maven
# Central publishes its runnable Quarkus app as io.apicurio:apicurio-registry-app:VERSION,
# classifier "all", a tar.gz: nothing is built here. Its classes are Java 21 bytecode:
# a Java 21+ is looked for (JAVA_HOME, PATH, /usr/lib/jvm/*) and, when none is found,
# Debian's openjdk-21-jre-headless is installed. Storage is its in-memory H2 database:
# a restart starts empty (ids from 1 again), which is what the tests want.
# Quirks against Confluent's registry: the default compatibility is NONE (here BACKWARD,
# Confluent's default, via apicurio.rules.global.compatibility); GET /config/SUBJECT of
# a subject without its own level answers 200 NONE instead of 40408.

REGISTRY_HOME=$CACHE/apicurio-registry-$REGISTRY_VERSION

# registry_java: print a java binary of version 21 or newer, if there is one
registry_java() {
  local cand major
  for cand in ${JAVA_HOME:+$JAVA_HOME/bin/java} $(command -v java || true) /usr/lib/jvm/*/bin/java; do
    [ -x "$cand" ] || continue
    major=$("$cand" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java\.specification\.version = //p' | cut -d. -f1)
    [ -n "$major" ] && [ "$major" -ge 21 ] && { echo "$cand"; return 0; }
  done
  return 1
}

registry_fetch() {
  (
    flock -w 600 9 || { echo "timed out waiting for $REGISTRY_HOME.lock" >&2; exit 1; }
    [ -f "$REGISTRY_HOME/quarkus-run.jar" ] && exit 0   # another run just finished it
    local dl=$REGISTRY_HOME.dl
    rm -rf "$dl" "$REGISTRY_HOME.tmp" && mkdir -p "$dl" "$REGISTRY_HOME.tmp" || exit 1
    mvn -B -q -Dstyle.color=never -Dmaven.repo.local="$dl/m2" \
      org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy \
      -Dartifact="io.apicurio:apicurio-registry-app:$REGISTRY_VERSION:tar.gz:all" \
      -DoutputDirectory="$dl" || exit 1
    tar -xzf "$dl/apicurio-registry-app-$REGISTRY_VERSION-all.tar.gz" -C "$REGISTRY_HOME.tmp" || exit 1
    [ -f "$REGISTRY_HOME.tmp/quarkus-run.jar" ] || { echo "quarkus-run.jar missing in the archive" >&2; exit 1; }
    rm -rf "$dl" "$REGISTRY_HOME" && mv "$REGISTRY_HOME.tmp" "$REGISTRY_HOME"   # complete or absent
  ) 9> "$REGISTRY_HOME.lock"
}

ensure_registry() {
  local pkgs=()
  registry_java > /dev/null || pkgs+=(openjdk-21-jre-headless)
  if [ ! -f "$REGISTRY_HOME/quarkus-run.jar" ]; then command -v mvn > /dev/null 2>&1 || pkgs+=(maven); fi
  if [ ${#pkgs[@]} -gt 0 ]; then apt_install "${pkgs[@]}" || return 1; fi
  registry_java > /dev/null || { err "registry: no Java 21 or newer found after installing ${pkgs[*]}"; return 1; }
  [ -f "$REGISTRY_HOME/quarkus-run.jar" ] && return 0
  mkdir -p "$CACHE"
  log "registry: fetching Apicurio Registry $REGISTRY_VERSION from Maven Central into $REGISTRY_HOME"
  run_quiet "apicurio-registry-$REGISTRY_VERSION-fetch" registry_fetch
}

start_registry() {
  local d=$DIR/registry java
  mkdir -p "$d"
  if alive registry; then log "registry: already running (pid $(pid_of "$d/pid"))"; return 0; fi
  check_ports_free registry || return 1
  java=$(registry_java) || { err "registry: no Java 21 or newer"; return 1; }
  # The management interface (health, metrics) is fixed on at build time; by default it
  # would listen on 0.0.0.0:9000.
  launch registry "$d/registry.log" "$java" -Xmx"$REGISTRY_HEAP" -XX:+UseSerialGC \
    -Dquarkus.http.host="$HOST" -Dquarkus.http.port="$REGISTRY_PORT" \
    -Dquarkus.management.host="$HOST" -Dquarkus.management.port="$REGISTRY_MGMT_PORT" \
    -Dapicurio.rules.global.compatibility=BACKWARD \
    -Dapicurio.datasource.jdbc.initial-size=2 -Dapicurio.datasource.jdbc.min-size=2 \
    -jar "$REGISTRY_HOME/quarkus-run.jar"
  log "registry: starting Apicurio Registry $REGISTRY_VERSION (in-memory storage)"
}

wait_registry() {
  local t0=$SECONDS url="http://$HOST:$REGISTRY_PORT/apis/ccompat/v7/subjects"
  wait_ports registry || return 1
  # The port opens before the API answers.
  until [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url")" = 200 ]; do
    alive registry || { fail registry "exited before its API answered"; return 1; }
    ((SECONDS - t0 < WAIT_TIMEOUT)) || { fail registry "$url did not answer 200 within ${WAIT_TIMEOUT}s"; return 1; }
    sleep 0.3
  done
}

stop_registry() { stop_pid registry "$DIR/registry/pid" "$(pattern_of registry)"; }

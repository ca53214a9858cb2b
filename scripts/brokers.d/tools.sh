# scripts/brokers.d/tools.sh - `scripts/brokers browser`, `promtool`, `nft`, `oidc` and
# `asyncapi`: what the tests and the lint need besides the brokers; sourced by scripts/brokers (not run).

cmd_browser() {
  if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    log "browser: $(chromium --version 2>/dev/null | head -n 1), $(chromedriver --version 2>/dev/null | cut -d' ' -f1-2)"
    return 0
  fi
  apt_install chromium chromium-driver || return 1
  command -v chromedriver >/dev/null 2>&1 || { err "browser: chromedriver missing after the install"; return 1; }
  log "browser: $(chromium --version 2>/dev/null | head -n 1) installed"
}

# `apt_tool COMMAND PACKAGE`: COMMAND from Debian's PACKAGE, installed when missing.
apt_tool() {
  local cmd=$1 package=$2
  if command -v "$cmd" >/dev/null 2>&1; then
    log "$cmd: $("$cmd" --version 2>&1 | head -n 1)"
    return 0
  fi
  apt_install "$package" || return 1
  command -v "$cmd" >/dev/null 2>&1 || { err "$cmd missing after installing $package"; return 1; }
  log "$cmd: $("$cmd" --version 2>&1 | head -n 1) installed"
}

# Debian's prometheus package ships promtool (its service is not started: policy-rc.d).
cmd_promtool() { apt_tool promtool prometheus; }

# The chaos tests' packet loss (integration/src/packet_loss.rs) is an nftables table:
# Debian's nftables package for `nft` (root is needed to load the rules).
cmd_nft() { apt_tool nft nftables; }

# `npm_tool NAME PACKAGE FILES...`: scripts/NAME's package.json, lock file and FILES in
# DIR/NAME with the locked packages (npm ci only when the lock changed since the last
# install); Node.js 20+ from Debian when missing. PACKAGE is the one whose version is logged.
npm_tool() {
  local name=$1 package=$2
  shift 2
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    apt_install nodejs npm || return 1
  fi
  local major
  major=$(node --version 2>/dev/null | sed 's/^v\([0-9]*\).*/\1/')
  if [ "${major:-0}" -lt 20 ]; then
    err "$name: $package needs Node.js 20 or later; this machine has $(node --version 2>/dev/null)"
    return 1
  fi
  local dir="$DIR/$name" src="$ROOT/scripts/$name" file
  mkdir -p "$dir" "$INSTALL_LOGS" || { err "$name: cannot create $dir"; return 1; }
  cp "$src/package.json" "$src/package-lock.json" "$dir/"
  for file in "$@"; do cp "$src/$file" "$dir/"; done
  local version="require('$dir/node_modules/$package/package.json').version"
  if [ -d "$dir/node_modules/$package" ] && cmp -s "$src/package-lock.json" "$dir/.installed-lock"; then
    log "$name: $package $(node -p "$version") on node $(node --version)"
    return 0
  fi
  (cd "$dir" && run_quiet "npm-ci-$name" npm ci --no-audit --no-fund) || { err "$name: npm ci failed"; return 1; }
  cp "$src/package-lock.json" "$dir/.installed-lock"
  log "$name: $package $(node -p "$version") installed on node $(node --version)"
}

# The console's single sign-on tests start a real OpenID provider (scripts/oidc/provider.mjs,
# npm's oidc-provider) on a free port of their own; this puts it and its locked packages in
# DIR/oidc (the tests look there, or in RELIQ_OIDC_PROVIDER_DIR).
cmd_oidc() { npm_tool oidc oidc-provider provider.mjs; }

# `just lint` validates the AsyncAPI documents of docs/asyncapi/ with the official parser
# (npm's @asyncapi/parser, with its Avro and Protobuf schema parsers): scripts/asyncapi's
# validate.mjs and its locked packages in DIR/asyncapi.
cmd_asyncapi() { npm_tool asyncapi @asyncapi/parser validate.mjs; }

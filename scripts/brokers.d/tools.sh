# scripts/brokers.d/tools.sh - `scripts/brokers browser`, `promtool`, `nft` and `oidc`: what the
# tests need besides the brokers; sourced by scripts/brokers (not run).

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

# The console's single sign-on tests start a real OpenID provider (scripts/oidc/provider.mjs,
# npm's oidc-provider) on a free port of their own; this puts it and its locked packages in
# DIR/oidc (the tests look there, or in RELIQ_OIDC_PROVIDER_DIR).
cmd_oidc() {
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    apt_install nodejs npm || return 1
  fi
  local major
  major=$(node --version 2>/dev/null | sed 's/^v\([0-9]*\).*/\1/')
  if [ "${major:-0}" -lt 20 ]; then
    err "oidc: oidc-provider needs Node.js 20 or later; this machine has $(node --version 2>/dev/null)"
    return 1
  fi
  local dir="$DIR/oidc" src="$ROOT/scripts/oidc"
  mkdir -p "$dir" "$INSTALL_LOGS" || { err "oidc: cannot create $dir"; return 1; }
  cp "$src/package.json" "$src/package-lock.json" "$src/provider.mjs" "$dir/"
  # npm ci only when the lock file changed since the last install.
  if [ -d "$dir/node_modules/oidc-provider" ] && cmp -s "$src/package-lock.json" "$dir/.installed-lock"; then
    log "oidc: oidc-provider $(node -p "require('$dir/node_modules/oidc-provider/package.json').version") on node $(node --version)"
    return 0
  fi
  (cd "$dir" && run_quiet npm-ci npm ci --no-audit --no-fund) || { err "oidc: npm ci failed"; return 1; }
  cp "$src/package-lock.json" "$dir/.installed-lock"
  log "oidc: oidc-provider $(node -p "require('$dir/node_modules/oidc-provider/package.json').version") installed on node $(node --version)"
}

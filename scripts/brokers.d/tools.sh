# scripts/brokers.d/tools.sh - `scripts/brokers browser` and `scripts/brokers promtool`:
# Debian packages the tests need besides the brokers; sourced by scripts/brokers (not run).

cmd_browser() {
  if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    log "browser: $(chromium --version 2>/dev/null | head -n 1), $(chromedriver --version 2>/dev/null | cut -d' ' -f1-2)"
    return 0
  fi
  apt_install chromium chromium-driver || return 1
  command -v chromedriver >/dev/null 2>&1 || { err "browser: chromedriver missing after the install"; return 1; }
  log "browser: $(chromium --version 2>/dev/null | head -n 1) installed"
}

cmd_promtool() {
  if command -v promtool >/dev/null 2>&1; then
    log "promtool: $(promtool --version 2>&1 | head -n 1)"
    return 0
  fi
  # Debian's prometheus package ships promtool (its service is not started: policy-rc.d).
  apt_install prometheus || return 1
  command -v promtool >/dev/null 2>&1 || { err "promtool missing after installing prometheus"; return 1; }
  log "promtool: $(promtool --version 2>&1 | head -n 1) installed"
}

#!/usr/bin/env bash
# Install the AsyncAPI CLI and HTML template (pinned in deploy/asyncapi/package-lock.json) into
# .tools/asyncapi, for `make test` (tests/test_asyncapi.py validates docs/asyncapi.yaml with the
# official CLI) and `make asyncapi` (renders it to HTML). Never needed at run time.
# Idempotent: does nothing when the installed lock file equals the pinned one.
set -euo pipefail
DEST=.tools/asyncapi
SRC=deploy/asyncapi
say() { echo "[asyncapi] $*" >&2; }
if ! command -v npm >/dev/null 2>&1; then
  say "npm not found; installing Node.js with apt"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >&2
fi
if [ -x "$DEST/node_modules/.bin/asyncapi" ] && cmp -s "$SRC/package-lock.json" "$DEST/package-lock.json"; then
  exit 0
fi
say "installing @asyncapi/cli and @asyncapi/html-template into $DEST (about a minute)"
mkdir -p "$DEST"
cp "$SRC/package.json" "$SRC/package-lock.json" "$DEST/"
# the HTML template's puppeteer would download a browser (PDF output only; not used here)
(cd "$DEST" && PUPPETEER_SKIP_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error >&2)
# no usage analytics from a test run (the CLI would try to reach the network)
echo '{"analyticsEnabled":"false","infoMessageShown":"true","userID":"fedfleet"}' > "$DEST/analytics.json"

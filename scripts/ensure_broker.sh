#!/usr/bin/env bash
# Make a RabbitMQ broker available for `make run` / `make test`, in this order:
#   1. RABBITMQ_URL if set (must answer, or we fail: the user asked for that broker);
#   2. the local broker on 127.0.0.1:5672;
#   3. start the installed rabbitmq-server if it is stopped;
#   4. install rabbitmq-server with apt (root) and start it.
# Prints the URL to use on stdout; progress goes to stderr.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
probe() { "$PY" -c "import sys; from shared.transport.amqp import broker_reachable as b; sys.exit(0 if b(sys.argv[1], 3) else 1)" "$1"; }
say() { echo "[broker] $*" >&2; }

if [ -n "${RABBITMQ_URL:-}" ]; then
  if probe "$RABBITMQ_URL"; then echo "$RABBITMQ_URL"; exit 0; fi
  say "RABBITMQ_URL is set but the broker does not answer: $RABBITMQ_URL"; exit 1
fi
LOCAL="amqp://guest:guest@127.0.0.1:5672/%2F"
# Plugins fedfleet needs on the local broker (idempotent, local broker only):
#   rabbitmq_management — the server creates one broker user per client host through its HTTP API
#                         (docs/security.md), and the security tests make role users with it;
#   rabbitmq_prometheus — RabbitMQ's own exporter (queue depths on the dashboard).
enable_exporter() {
  local plugins p; plugins=$(command -v rabbitmq-plugins || echo /usr/sbin/rabbitmq-plugins)
  [ -x "$plugins" ] || return 0
  for p in rabbitmq_management rabbitmq_prometheus; do
    if ! "$plugins" is_enabled "$p" >/dev/null 2>&1; then
      say "enabling $p"
      "$plugins" enable "$p" >&2 || say "could not enable $p"
    fi
  done
}
if probe "$LOCAL"; then enable_exporter; echo "$LOCAL"; exit 0; fi

if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
  say "rabbitmq-server is not installed; installing it with apt"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq rabbitmq-server >&2
fi
say "starting rabbitmq-server"
(PATH=$PATH:/usr/sbin rabbitmq-server -detached >&2 2>&1 || true)
for _ in $(seq 1 60); do
  if probe "$LOCAL"; then say "broker is up"; enable_exporter; echo "$LOCAL"; exit 0; fi
  sleep 2
done
say "rabbitmq-server did not come up within 120 s; see /var/log/rabbitmq/"
exit 1

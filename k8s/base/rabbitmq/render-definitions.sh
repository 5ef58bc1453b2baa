#!/bin/sh
# Renders RabbitMQ definitions (vhost, one user per role, least-privilege permissions) from the
# environment into $OUT. Runs as the rabbitmq pod's init container; the passwords come from the
# rabbitmq-credentials Secret and never sit in the repository or a ConfigMap.
#
# Permissions (configure / write / read regexes on vhost "/"; E = the experiment id, dots escaped):
#   fedfleet-server      ^ff\.E(\..+)?$ for all three: it owns the experiment's topology
#   fedfleet-aggregator  ff.E, ff.E.dlx, ff.E.dead, ff.E.updates, ff.E.agg.*
#   fedfleet-client      configure/write ff.E, ff.E.dlx, ff.E.dead, ff.E.client.*;
#                        read ff.E, ff.E.dlx, ff.E.client.*  (never the updates or server queues)
# Publishing needs write on the exchange (ff.E, or ff.E.dlx to dead-letter); binding a queue needs
# write on the queue and read on the exchange; consuming needs read on the queue.
set -eu

OUT=${OUT:-/etc/rabbitmq/definitions/definitions.json}
: "${FEDFLEET_EXPERIMENT:?FEDFLEET_EXPERIMENT is not set}"
case "$FEDFLEET_EXPERIMENT" in
  *[!A-Za-z0-9_.-]*) echo "FEDFLEET_EXPERIMENT '$FEDFLEET_EXPERIMENT' has characters outside [A-Za-z0-9_.-]" >&2; exit 1 ;;
esac

for var in ADMIN_PASSWORD SERVER_PASSWORD AGGREGATOR_PASSWORD CLIENT_PASSWORD; do
  eval "value=\${$var:-}"
  if [ -z "$value" ]; then
    echo "$var is empty: create the rabbitmq-credentials Secret first (make -f deploy/k8s.mk secrets)" >&2
    exit 1
  fi
  case "$value" in
    # passwords are also embedded in AMQP URLs and in JSON: keep them to URL- and JSON-safe characters
    *[!A-Za-z0-9_-]*) echo "$var must only contain [A-Za-z0-9_-]" >&2; exit 1 ;;
  esac
done
ADMIN_USER=${ADMIN_USER:-admin}

# In JSON a regex backslash is written twice: "^ff\\.e1" is the regex ^ff\.e1
E=$(printf '%s' "$FEDFLEET_EXPERIMENT" | sed 's/\./\\\\./g')
D='\\.'
SERVER_RE="^ff${D}${E}(${D}.+)?\$"
AGG_RE="^ff${D}${E}(${D}(dlx|dead|updates|agg${D}.+))?\$"
CLIENT_CW_RE="^ff${D}${E}(${D}(dlx|dead|client${D}.+))?\$"
CLIENT_R_RE="^ff${D}${E}(${D}(dlx|client${D}.+))?\$"

mkdir -p "$(dirname "$OUT")"
umask 077
cat > "$OUT" <<JSON
{
  "vhosts": [{"name": "/"}],
  "users": [
    {"name": "${ADMIN_USER}", "password": "${ADMIN_PASSWORD}", "tags": "administrator"},
    {"name": "fedfleet-server", "password": "${SERVER_PASSWORD}", "tags": ""},
    {"name": "fedfleet-aggregator", "password": "${AGGREGATOR_PASSWORD}", "tags": ""},
    {"name": "fedfleet-client", "password": "${CLIENT_PASSWORD}", "tags": ""}
  ],
  "permissions": [
    {"user": "${ADMIN_USER}", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
    {"user": "fedfleet-server", "vhost": "/", "configure": "${SERVER_RE}", "write": "${SERVER_RE}", "read": "${SERVER_RE}"},
    {"user": "fedfleet-aggregator", "vhost": "/", "configure": "${AGG_RE}", "write": "${AGG_RE}", "read": "${AGG_RE}"},
    {"user": "fedfleet-client", "vhost": "/", "configure": "${CLIENT_CW_RE}", "write": "${CLIENT_CW_RE}", "read": "${CLIENT_R_RE}"}
  ]
}
JSON
echo "wrote $OUT: users ${ADMIN_USER}, fedfleet-server, fedfleet-aggregator, fedfleet-client for experiment $FEDFLEET_EXPERIMENT"

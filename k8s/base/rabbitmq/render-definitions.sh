#!/bin/sh
# Renders RabbitMQ's definitions (vhost, the fixed role users, their permissions and topic
# permissions) into $OUT from definitions.template.json, which deploy/k8s/generate.py writes from
# shared.provision.role_permissions: the permissions exist once, in Python, and this script only fills
# in the placeholders. It runs as the rabbitmq pod's init container (the broker image has no Python);
# the passwords come from the rabbitmq-credentials Secret and never sit in the repository or a
# ConfigMap. Client hosts' own users are not here: the server makes them when hosts join.
set -eu

OUT=${OUT:-/etc/rabbitmq/definitions/definitions.json}
TEMPLATE=${TEMPLATE:-$(dirname "$0")/definitions.template.json}
: "${FEDFLEET_EXPERIMENT:?FEDFLEET_EXPERIMENT is not set}"
PREFIX=${FEDFLEET_USER_PREFIX:-fedfleet-}
case "$FEDFLEET_EXPERIMENT" in
  *[!A-Za-z0-9_.-]*) echo "FEDFLEET_EXPERIMENT '$FEDFLEET_EXPERIMENT' has characters outside [A-Za-z0-9_.-]" >&2; exit 1 ;;
esac
case "$PREFIX" in
  *[!A-Za-z0-9_.-]*) echo "FEDFLEET_USER_PREFIX '$PREFIX' has characters outside [A-Za-z0-9_.-]" >&2; exit 1 ;;
esac

for var in ADMIN_PASSWORD SERVER_PASSWORD AGGREGATOR_PASSWORD JOIN_PASSWORD; do
  eval "value=\${$var:-}"
  if [ -z "$value" ]; then
    echo "$var is empty: create the rabbitmq-credentials Secret first (make secrets)" >&2
    exit 1
  fi
  case "$value" in
    # passwords are also embedded in AMQP URLs and in JSON: keep them to URL- and JSON-safe characters
    *[!A-Za-z0-9_-]*) echo "$var must only contain [A-Za-z0-9_-]" >&2; exit 1 ;;
  esac
done

# Python's re.escape of the id ('.' and '-' get a backslash), written for JSON (the backslash twice),
# and each of those twice again for the sed replacement below
E_RE=$(printf '%s' "$FEDFLEET_EXPERIMENT" | sed 's/[.-]/\\\\\\\\&/g')

mkdir -p "$(dirname "$OUT")"
umask 077
sed -e "s|@EXPERIMENT_RE@|$E_RE|g" -e "s|@EXPERIMENT@|$FEDFLEET_EXPERIMENT|g" -e "s|@PREFIX@|$PREFIX|g" \
    -e "s|@ADMIN_PASSWORD@|$ADMIN_PASSWORD|g" -e "s|@SERVER_PASSWORD@|$SERVER_PASSWORD|g" \
    -e "s|@AGGREGATOR_PASSWORD@|$AGGREGATOR_PASSWORD|g" -e "s|@JOIN_PASSWORD@|$JOIN_PASSWORD|g" \
    "$TEMPLATE" > "$OUT"
echo "wrote $OUT: users ${PREFIX}admin, ${PREFIX}server, ${PREFIX}aggregator, ${PREFIX}join for experiment $FEDFLEET_EXPERIMENT"

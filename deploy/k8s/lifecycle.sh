#!/bin/sh
# The experiment's life on Kubernetes, for deploy/k8s.mk: `make up`, `make wait`, `make scale`,
# `make results`. Kept out of the Makefile so each step can say what it is doing in plain shell.
#
#   lifecycle.sh prepare            before `kubectl apply`: a finished run's Jobs are deleted (Jobs
#                                   are immutable and run once), a running one stops `make up`
#   lifecycle.sh wait               follow the run: progress lines until the server Job is Complete
#                                   (then the clients are scaled to 0) or Failed (exit 1, with why)
#   lifecycle.sh scale N            set the client hosts to N >= 1
#   lifecycle.sh results [RUN]      copy runs/RUN out of the server's volume (default: the deployed
#                                   experiment) through a short-lived pod, deploy/k8s/results-pod.yaml
#
# Environment: KUBECTL, NAMESPACE, IMAGE, K8S_TIMEOUT, POLL_S (seconds between progress checks).
set -eu

KUBECTL=${KUBECTL:-kubectl}
NAMESPACE=${NAMESPACE:-fedfleet}
IMAGE=${IMAGE:-fedfleet:dev}
K8S_TIMEOUT=${K8S_TIMEOUT:-600s}
POLL_S=${POLL_S:-10}
HERE=$(cd "$(dirname "$0")" && pwd)

k() { "$KUBECTL" -n "$NAMESPACE" "$@"; }

# Complete | Failed | Running | Absent
job_state() {
  if ! k get job "$1" >/dev/null 2>&1; then echo Absent; return; fi
  conds=$(k get job "$1" -o jsonpath='{range .status.conditions[?(@.status=="True")]}{.type} {end}')
  case " $conds " in
    *" Complete "*) echo Complete ;;
    *" Failed "*) echo Failed ;;
    *) echo Running ;;
  esac
}

# the experiment id of the deployed run (FEDFLEET_EXPERIMENT of the server's fedfleet-env ConfigMap)
experiment() {
  cm=$(k get job server -o jsonpath='{.spec.template.spec.containers[?(@.name=="server")].envFrom[*].configMapRef.name}' 2>/dev/null \
    | tr ' ' '\n' | grep '^fedfleet-env' | head -n 1) || true
  [ -n "$cm" ] && k get configmap "$cm" -o jsonpath='{.data.FEDFLEET_EXPERIMENT}'
}

prepare() {
  state=$(job_state server)
  case "$state" in
    Running)
      echo "error: an experiment ($(experiment || echo '?')) is still running. Follow it with 'make wait'," \
           "or end it with 'make down' (deletes everything) before 'make up' starts the next." >&2
      exit 1 ;;
    Complete | Failed)
      echo "the previous run's Jobs are finished ($state): deleting them (its results stay on the server-data volume)"
      k delete job server aggregator --ignore-not-found --wait=true >/dev/null ;;
  esac
}

fail_reason() {
  k get job server -o jsonpath='{range .status.conditions[?(@.type=="Failed")]}{.reason}: {.message}{"\n"}{end}'
  # the server's last words: its termination message (FallbackToLogsOnError: the log's tail)
  k get pods -l job-name=server \
    -o jsonpath='{range .items[*]}{.metadata.name}: {range .status.containerStatuses[*]}exit {.state.terminated.exitCode}: {.state.terminated.message}{end}{"\n"}{end}' 2>/dev/null \
    | tail -n 20
}

wait_run() {
  exp=$(experiment || true)
  echo "waiting for the broker..."
  k rollout status statefulset/rabbitmq --timeout="$K8S_TIMEOUT"
  echo "following run ${exp:-?} (Ctrl-C stops following, not the run; 'make wait' resumes)"
  last=""
  while :; do
    state=$(job_state server)
    case "$state" in
      Complete)
        echo "run ${exp:-?} is done."
        echo "scaling the client hosts to 0 (they idle after a run; 'make up' starts the next one)"
        k scale deployment/clients --replicas=0 >/dev/null
        # the aggregators exit on the server's stop (after their last scrape); one that started after
        # the stop was sent (a run resumed when already finished) would wait for ever
        if ! k wait --for=condition=complete job/aggregator --timeout=120s >/dev/null 2>&1; then
          echo "the aggregators did not stop within 120 s of the run's end: deleting their Job"
          k delete job aggregator --ignore-not-found --wait=false >/dev/null
        fi
        echo "copy the results out with: make results${exp:+ RUN=$exp}"
        return 0 ;;
      Failed)
        echo "run ${exp:-?} FAILED:" >&2
        fail_reason >&2
        return 1 ;;
      Absent)
        echo "error: no server Job in namespace $NAMESPACE: run 'make up' first" >&2
        return 1 ;;
    esac
    # progress: the newest round the server closed (its log line), and pods not running or restarted
    line=$(k logs job/server --tail=50 2>/dev/null | grep '"event": "round_done"' | tail -n 1 \
      | sed 's/.*"msg": "\([^"]*\)".*/\1/') || true
    pods=$(k get pods -l app.kubernetes.io/part-of=fedfleet --no-headers 2>/dev/null \
      | awk '$3 != "Running" && $3 != "Completed" {printf "%s=%s ", $1, $3}') || true
    restarts=$(k get pods -l app.kubernetes.io/part-of=fedfleet --no-headers 2>/dev/null | awk '$4 > 0 {printf "%s(%s) ", $1, $4}') || true
    now="${line:-starting} ${pods:+| not running: $pods}${restarts:+| restarted: $restarts}"
    if [ "$now" != "$last" ]; then
      echo "$(date -u +%H:%M:%S) $now"
      last=$now
    fi
    sleep "$POLL_S"
  done
}

scale() {
  n=${1:-}
  case "$n" in '' | *[!0-9]*) n=0 ;; esac
  if [ "$n" -lt 1 ]; then
    echo "usage: make scale CLIENTS=n   (n >= 1 client hosts; 'make down' removes everything)" >&2
    exit 1
  fi
  k scale deployment/clients --replicas="$n"
  if [ "$(job_state server)" != Running ]; then
    echo "no run in progress: the new client hosts wait for the next 'make up'"
    return 0
  fi
  echo "$n client hosts: the server leases every device to the live hosts, rebalanced between rounds"
  k rollout status deployment/clients --timeout="$K8S_TIMEOUT"
}

results() {
  run=${1:-}
  [ -n "$run" ] || run=$(experiment || true)
  if [ -z "$run" ]; then
    echo "error: which run? no server Job to read the experiment from: make results RUN=<id>" >&2
    exit 1
  fi
  pod=results-$(LC_ALL=C tr -dc 'a-z0-9' </dev/urandom | head -c 5)
  sed -e "s|name: results$|name: $pod|" -e "s|image: fedfleet:dev$|image: $IMAGE|" "$HERE/results-pod.yaml" | k apply -f - >/dev/null
  trap 'k delete pod "$pod" --wait=false >/dev/null 2>&1 || true' EXIT
  k wait --for=condition=Ready "pod/$pod" --timeout="$K8S_TIMEOUT" >/dev/null
  if ! k exec "$pod" -- test -d "/data/runs/$run"; then
    echo "error: no run '$run' on the server-data volume; there are: $(k exec "$pod" -- ls /data/runs | tr '\n' ' ')" >&2
    exit 1
  fi
  mkdir -p runs
  rm -rf "runs/$run"
  k cp "$pod:/data/runs/$run" "runs/$run" >/dev/null
  echo "copied runs/$run ($(find "runs/$run" -type f | wc -l) files); 'fedfleet report runs/$run' prints it"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  prepare) prepare ;;
  wait) wait_run ;;
  scale) scale "$@" ;;
  results) results "$@" ;;
  *) echo "usage: $0 prepare | wait | scale N | results [RUN]" >&2; exit 2 ;;
esac

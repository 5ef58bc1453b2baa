# Kubernetes targets for fedfleet. The top-level Makefile includes this file (`include deploy/k8s.mk`);
# it also works on its own: `make -f deploy/k8s.mk up`.
#
#   make image                 build the one image of all services (docker)
#   make kind-load             load it into a kind cluster   (KIND_CLUSTER=fedfleet)
#   make k3d-import            import it into a k3d cluster  (K3D_CLUSTER=fedfleet)
#   make up [OVERLAY=dev]      create secrets if missing, apply k8s/overlays/$(OVERLAY), follow the run
#                              until it is done (exit 0) or failed (exit 1, with the reason)
#   make wait                  follow the deployed run again (after Ctrl-C)
#   make scale CLIENTS=n       set the number of client hosts (n >= 1; the server leases them devices)
#   make results [RUN=id]      copy runs/<id>/ out of the cluster (default: the deployed experiment)
#   make status | logs [COMPONENT=client] [FOLLOW=1] | dashboard | down
#   make k8s-render [OVERLAY=dev]   print the manifests;   make k8s-generate   regenerate derived files
#
# Everything runs against the current kubeconfig context (`kubectl config current-context`).

K8S_MK_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))
K8S_ROOT := $(abspath $(K8S_MK_DIR)/..)

KUBECTL ?= kubectl
DOCKER ?= docker
OVERLAY ?= dev
NAMESPACE ?= fedfleet
IMAGE ?= fedfleet:dev
KIND_CLUSTER ?= fedfleet
K3D_CLUSTER ?= fedfleet
K8S_TIMEOUT ?= 600s
GRAFANA_PORT ?= 3000
TAIL ?= 100
COMPONENT ?=
FOLLOW ?=
K8S_PYTHON ?= $(if $(wildcard $(K8S_ROOT)/.venv/bin/python),$(K8S_ROOT)/.venv/bin/python,python3)

K8S_OVERLAY_DIR = $(K8S_ROOT)/k8s/overlays/$(OVERLAY)
# Shell snippet: render the overlay into $$tmp (a failure stops the recipe: dash has no pipefail, hence
# the file), then swap the image the overlays name (fedfleet:dev) for $(IMAGE) on stdout.
K8S_RENDER = set -e; tmp=$$(mktemp); trap 'rm -f "$$tmp"' EXIT; \
	$(KUBECTL) kustomize $(K8S_OVERLAY_DIR) > "$$tmp"; \
	sed -e 's|image: fedfleet:dev$$|image: $(IMAGE)|' "$$tmp"
K8S_NS = $(KUBECTL) -n $(NAMESPACE)
K8S_LIFECYCLE = KUBECTL="$(KUBECTL)" NAMESPACE="$(NAMESPACE)" IMAGE="$(IMAGE)" K8S_TIMEOUT="$(K8S_TIMEOUT)" \
	sh $(K8S_MK_DIR)/k8s/lifecycle.sh

.PHONY: image kind-load k3d-import up wait results scale status logs dashboard down secrets k8s-render k8s-generate \
        k8s-check-kubectl k8s-check-context k8s-check-overlay

k8s-check-kubectl:
	@command -v $(KUBECTL) >/dev/null 2>&1 || { \
	  echo "error: '$(KUBECTL)' not found. Install kubectl (https://kubernetes.io/docs/tasks/tools/ ;" \
	       "scripts/setup_deploy_tools.sh puts one in .venv/bin) or run with KUBECTL=/path/to/kubectl." >&2; \
	  exit 1; }

k8s-check-context: k8s-check-kubectl
	@ctx=$$($(KUBECTL) config current-context 2>/dev/null) && [ -n "$$ctx" ] || { \
	  echo "error: no current kubeconfig context. Create a cluster (e.g. 'kind create cluster --name $(KIND_CLUSTER)'" \
	       "or 'k3d cluster create $(K3D_CLUSTER)') or select one with 'kubectl config use-context NAME'." >&2; \
	  exit 1; }; \
	echo "kubeconfig context: $$ctx"

k8s-check-overlay:
	@[ -f "$(K8S_OVERLAY_DIR)/kustomization.yaml" ] || { \
	  echo "error: no overlay '$(OVERLAY)'; choose one of: $$(ls $(K8S_ROOT)/k8s/overlays | tr '\n' ' ')" >&2; exit 1; }

image:
	@command -v $(DOCKER) >/dev/null 2>&1 || { echo "error: '$(DOCKER)' not found: install Docker (or set DOCKER=podman)" >&2; exit 1; }
	DOCKER_BUILDKIT=1 $(DOCKER) build -f $(K8S_ROOT)/deploy/Dockerfile -t $(IMAGE) $(K8S_ROOT)

kind-load:
	kind load docker-image $(IMAGE) --name $(KIND_CLUSTER)

k3d-import:
	k3d image import $(IMAGE) --cluster $(K3D_CLUSTER)

k8s-render: k8s-check-kubectl k8s-check-overlay
	@$(K8S_RENDER)

k8s-generate:
	$(K8S_PYTHON) $(K8S_ROOT)/deploy/k8s/generate.py

# Secrets are created in the cluster, never committed: random passwords, only when missing, so
# `make up` can be re-run without locking the services out of the broker.
secrets: k8s-check-context
	@$(KUBECTL) create namespace $(NAMESPACE) --dry-run=client -o yaml | $(KUBECTL) apply -f - >/dev/null
	@gen() { LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 24; }; \
	if $(K8S_NS) get secret rabbitmq-credentials >/dev/null 2>&1; then \
	  echo "secret rabbitmq-credentials exists (kept)"; \
	else \
	  $(K8S_NS) create secret generic rabbitmq-credentials \
	    --from-literal=admin-password="$$(gen)" --from-literal=server-password="$$(gen)" \
	    --from-literal=aggregator-password="$$(gen)" --from-literal=join-password="$$(gen)" >/dev/null && \
	  $(K8S_NS) label secret rabbitmq-credentials app.kubernetes.io/part-of=fedfleet >/dev/null && \
	  echo "created secret rabbitmq-credentials (random passwords, one per broker user)"; \
	fi; \
	if $(K8S_NS) get secret grafana-admin >/dev/null 2>&1; then \
	  echo "secret grafana-admin exists (kept)"; \
	else \
	  $(K8S_NS) create secret generic grafana-admin --from-literal=admin-password="$$(gen)" >/dev/null && \
	  $(K8S_NS) label secret grafana-admin app.kubernetes.io/part-of=fedfleet >/dev/null && \
	  echo "created secret grafana-admin (random password)"; \
	fi; \
	if $(K8S_NS) get secret rabbitmq-erlang-cookie >/dev/null 2>&1; then \
	  echo "secret rabbitmq-erlang-cookie exists (kept)"; \
	else \
	  $(K8S_NS) create secret generic rabbitmq-erlang-cookie \
	    --from-literal=cookie="$$(LC_ALL=C tr -dc 'a-f0-9' </dev/urandom | head -c 64)" >/dev/null && \
	  $(K8S_NS) label secret rabbitmq-erlang-cookie app.kubernetes.io/part-of=fedfleet >/dev/null && \
	  echo "created secret rabbitmq-erlang-cookie (the ha overlay's 3 broker nodes share it)"; \
	fi

# An experiment is a run to completion: the server and aggregators are Jobs, the clients a Deployment
# of hosts (docs/kubernetes.md, "Lifecycle"). `up` deletes a finished run's Jobs first, so the next
# experiment starts without `make down`; it refuses while a run is still going.
up: k8s-check-context k8s-check-overlay secrets
	@$(K8S_LIFECYCLE) prepare
	@echo "applying overlay $(OVERLAY) with image $(IMAGE) to namespace $(NAMESPACE)"
	@$(K8S_RENDER) | $(KUBECTL) apply -f -
	@echo ""
	@echo "Grafana: 'make dashboard' in another terminal, then http://localhost:$(GRAFANA_PORT)/ (anonymous viewer;"
	@echo "  admin password: kubectl -n $(NAMESPACE) get secret grafana-admin -o jsonpath='{.data.admin-password}' | base64 -d)"
	@echo "Scale the clients with 'make scale CLIENTS=n', follow them with 'make logs COMPONENT=client FOLLOW=1'."
	@$(K8S_LIFECYCLE) wait

wait: k8s-check-context
	@$(K8S_LIFECYCLE) wait

results: k8s-check-context
	@$(K8S_LIFECYCLE) results $(RUN)

scale: k8s-check-context
	@$(K8S_LIFECYCLE) scale "$(CLIENTS)"

status: k8s-check-context
	$(K8S_NS) get job,statefulset,deployment,pod,service,pvc -o wide

logs: k8s-check-context
	$(K8S_NS) logs -l app.kubernetes.io/part-of=fedfleet$(if $(COMPONENT),$(comma)app.kubernetes.io/component=$(COMPONENT)) \
	  --all-containers --prefix --tail=$(TAIL) --max-log-requests=100 $(if $(FOLLOW),--follow)

dashboard: k8s-check-context
	@echo "Grafana on http://localhost:$(GRAFANA_PORT)/  (Ctrl-C to stop the port-forward)"
	$(K8S_NS) port-forward service/grafana $(GRAFANA_PORT):3000

down: k8s-check-context
	@echo "deleting namespace $(NAMESPACE): every fedfleet object, its secrets and volumes (checkpoints, broker data)"
	$(KUBECTL) delete namespace $(NAMESPACE) --ignore-not-found --wait --timeout=$(K8S_TIMEOUT)

comma := ,

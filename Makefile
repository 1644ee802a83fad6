# Two entry points: `make demo` and `make test`. Both create .venv and install into it.
# torch is installed first at exactly 2.13.0 (the CPU wheel on the machine) so pip never
# resolves a fresh torch with GBs of CUDA packages.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC := torch==2.13.0
# Debian packages that the tests start for real: etcd, Prometheus, ip for network namespaces,
# libfaketime for a test host whose wall clock is off.
DEB_PKGS := etcd-server prometheus iproute2 faketime openssl slurm-wlm munge

.PHONY: demo test test-loaded check docs install debs bench clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) setup.py pyproject.toml
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q $(TORCH_SPEC) numpy
	$(VPY) -m pip install -q -e '.[test,plots,docs]'
	touch $(STAMP)

install: $(STAMP)

debs:
	@missing=""; \
	for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

demo: install
	$(VPY) examples/demo.py
	$(VPY) examples/demo_inplace.py
	$(VPY) examples/demo_snapshot.py

# Lint, types and the layer contract; configuration in pyproject.toml.
check: install
	$(VENV)/bin/ruff check elastictk tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@d=$$(mktemp -d); NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir $$d; \
	rc=$$?; rm -rf $$d; exit $$rc

# The docs site (docs/*.md, the README as its home page, the API reference from docstrings)
# into site/; open site/index.html. Broken links and anchors fail the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# A private base temp dir: pytest runs that share /tmp/pytest-of-<user> delete each other's dirs.
# Four test processes (pytest-xdist) on two cores, each taking whole files: most tests wait on
# heartbeats, timeouts and real daemons, so with three the suite used about 1.5 of the 2 cores
# (1,300-1,400 s of CPU; pytest 772 s and 911 s in two idle runs); with four, 616 and 618 s of
# pytest idle (1,052 s of CPU) since workers' preload servers skip torch._dynamo where unused and
# the suite loads bytecode, and the loaded run stays green (README).
TEST_WORKERS ?= 4
# Bytecode for every module, written before the suite: with PYTHONDONTWRITEBYTECODE set (CI
# hosts set it) each of the suite's ~1,000 Python processes compiled elastictk from source again
# (0.2-0.3 s of CPU per agent). compileall writes it regardless; a source edited later is
# compiled afresh by the interpreter (the pyc names its source's mtime), so nothing goes stale.
BYTECODE := $(VPY) -m compileall -q -j 0 elastictk tests bench examples >/dev/null
test: install debs check
	@$(BYTECODE)
	@bt=$$(mktemp -d /tmp/elastictk-tests.XXXXXX); \
	$(VPY) -m pytest -q tests --basetemp=$$bt -n $(TEST_WORKERS) --dist loadfile; rc=$$?; rm -rf $$bt; exit $$rc

# The same suite beside one busy process per core (normal priority), started before pytest and
# killed by PID after it, whatever pytest's exit (tests/helpers/loaded.py): agents run beside data
# loaders that take every core, so heartbeats, watches and timers must hold there, and tests wait
# on events, never on bounds tuned to an idle machine. LOAD_HOGS=N for another count; each test
# gets 900 s, not 300 (pytest-timeout's per-test bound is itself tuned to an idle machine).
LOAD_HOGS ?= $(shell nproc)
test-loaded: install debs check
	@$(BYTECODE)
	@bt=$$(mktemp -d /tmp/elastictk-tests.XXXXXX); \
	$(VPY) -m tests.helpers.loaded --hogs $(LOAD_HOGS) -- \
	  $(VPY) -m pytest -q tests --basetemp=$$bt -n $(TEST_WORKERS) --dist loadfile --timeout 900; rc=$$?; rm -rf $$bt; exit $$rc

bench: install
	$(VPY) -m bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis site

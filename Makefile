# Two commands do all of the setup on a fresh machine:
#   make run   - create .venv, install everything, train the main example (M6-mini)
#   make test  - create .venv, install everything, run the whole test suite
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.epl-installed
EXAMPLE ?= examples/m6_mini.py
# tf.compat.v1.layers needs legacy Keras (tf-keras, requirements-nodeps.txt)
export TF_USE_LEGACY_KERAS := 1

.PHONY: setup run test bench clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt setup.py tools/build_horovod.sh
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip wheel setuptools
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -r requirements-nodeps.txt
	bash tools/build_horovod.sh $(VPY)
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

run: setup
	$(VPY) $(EXAMPLE)

test: setup
	$(VPY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info

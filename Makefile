# Two commands do all of the setup on a fresh machine:
#   make run   - create .venv, install everything, train the main example (M6-mini)
#   make test  - create .venv, install everything, run the whole test suite
# The build follows the machine (scripts/select_device.py): "gpu" where nvidia-smi
# lists a GPU (tensorflow[and-cuda], Horovod with NCCL), "cpu" otherwise
# (tensorflow-cpu, Horovod with Gloo); EPL_DEVICE=cpu|gpu forces either.
#   make gpu-check - on a machine with NVIDIA GPUs: the GPU checks (docs/gpu.md)
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
EXAMPLE ?= examples/m6_mini.py
# tf.compat.v1.layers needs legacy Keras (tf-keras, requirements-nodeps.txt)
export TF_USE_LEGACY_KERAS := 1

DEVICE := $(shell $(PY) scripts/select_device.py)
ifeq ($(DEVICE),)
$(error scripts/select_device.py chose no device kind; its message is above)
endif
# Both TensorFlow packages provide the module `tensorflow`: switching kinds
# removes the other one first.
OTHER_TF_cpu := tensorflow
OTHER_TF_gpu := tensorflow-cpu
STAMP := $(VENV)/.epl-installed-$(DEVICE)
# EPL's distribution was named `epl` before it became `epl-tf` (pyproject.toml;
# `epl` on PyPI is an unrelated project): setup drops an install of the old name.

.PHONY: setup run test bench clean gpu-check

setup: $(STAMP)

$(STAMP): requirements.txt requirements-$(DEVICE).txt requirements-nodeps.txt pyproject.toml \
		scripts/build_horovod.sh scripts/patch_horovod_tf.py scripts/patch_horovod_runner.py \
		scripts/select_device.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip wheel setuptools
	if $(VPY) -m pip show -q $(OTHER_TF_$(DEVICE)) >/dev/null 2>&1; then \
		$(VPY) -m pip uninstall -q -y $(OTHER_TF_$(DEVICE)); fi
	$(VPY) -m pip install -q -r requirements.txt -r requirements-$(DEVICE).txt
	$(VPY) -m pip install -q --no-deps -r requirements-nodeps.txt
	EPL_DEVICE=$(DEVICE) bash scripts/build_horovod.sh $(VPY)
	if $(VPY) -m pip show -q epl >/dev/null 2>&1; then $(VPY) -m pip uninstall -q -y epl; fi
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.epl-installed*
	touch $(STAMP)

run: setup
	$(VPY) $(EXAMPLE)

test: setup
	$(VPY) -m pytest -q tests

# Says so and fails on a machine without NVIDIA GPUs before installing anything.
gpu-check:
	$(PY) scripts/gpu_check.py --preflight
	$(MAKE) --no-print-directory setup
	$(VPY) scripts/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info

# Every target installs what it needs into .venv first, so a fresh clone needs only Python.
PYTHON ?= python3
# TORCH=<release> (e.g. make test TORCH=2.9.1) runs a target on that torch release, in a venv
# of its own; without it, the release pinned in constraints.txt, in .venv.
PINNED_TORCH := $(shell sed -n 's/^torch==//p' constraints.txt)
TORCH ?= $(PINNED_TORCH)
ifeq ($(TORCH),$(PINNED_TORCH))
VENV := .venv
CONSTRAINTS := constraints.txt
else
VENV := .venv-torch$(TORCH)
CONSTRAINTS := $(VENV)/constraints.txt
endif
PY := $(VENV)/bin/python
# The differential fuzzer's cases per tier (tests/test_fuzz.py: 300 in make test, 4,000 in make
# test-integration): on another torch release, 150 in each unless COMM_FUZZ_CASES says otherwise.
ifneq ($(TORCH),$(PINNED_TORCH))
export COMM_FUZZ_CASES ?= 150
endif
# torch warns at import when numpy is absent; comm does not need numpy.
export PYTHONWARNINGS := ignore:Failed to initialize NumPy
export OMP_NUM_THREADS ?= 1
# pip installs without compiling every file of torch (about 30 s); each module is compiled
# once, when first imported, which needs bytecode writing on even where the caller turned it off.
export PYTHONDONTWRITEBYTECODE :=
TORCHRUN := $(PY) -m torch.distributed.run --standalone --nproc-per-node 2

.PHONY: test test-integration test-all test-clients test-peers test-torch-npu test-launchers demo bench lint gpu-check wheel test-wheel clean

# PIP_CONSTRAINT replaces any constraint file pip's own configuration names (a machine may cap
# torch's release there) with this venv's, which pins its torch.
$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	test "$(CONSTRAINTS)" = constraints.txt || echo "torch==$(TORCH)" > $(CONSTRAINTS)
	PIP_CONSTRAINT=$(CONSTRAINTS) $(PY) -m pip install --quiet --no-compile --editable '.[test]'
	touch $@

# The linters only where they run: make test need not install them (about 9 s).
$(VENV)/.lint-installed: $(VENV)/.installed
	PIP_CONSTRAINT=$(CONSTRAINTS) $(PY) -m pip install --quiet --no-compile --editable '.[test,lint]'
	touch $@

# Three tiers (docs/testing.md): make test runs the in-process and multi-rank tests; make
# test-integration the whole programs (examples, python -m comm, launchers, packaging, torch's
# own suites, compile); make test-all both at once. The C++ extensions are built first, once per
# machine (cached): ranks must not each compile at first use.
test: $(VENV)/.installed
	$(PY) -m comm.build --simulated
	$(PY) -m pytest -n auto -q -m "not integration"

test-integration: $(VENV)/.installed
	$(PY) -m comm.build --simulated
	$(PY) -m pytest -n auto -q -m integration

test-all: $(VENV)/.installed
	$(PY) -m comm.build --simulated
	$(PY) -m pytest -n auto -q

# The tier of real clients (issue 26): pinned frameworks in a venv of their own, so that make test
# stays free of them; one pip call, so that the resolver sees torch's pin beside every framework.
CLIENTS_VENV := .venv-clients
CLIENTS_PY := $(CLIENTS_VENV)/bin/python

$(CLIENTS_VENV)/.installed: setup.cfg pyproject.toml constraints.txt tests/clients/requirements.txt
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_PY) -m pip install --quiet --no-compile --constraint constraints.txt --editable '.[test]' \
		--requirement tests/clients/requirements.txt
	touch $@

# Frameworks whose pins clash with .venv-clients' run in a venv each, .venv-<name>, installed from
# tests/clients/<name>-requirements.txt (which says why): LLaMA-Factory and ms-swift cap transformers
# and Accelerate below the pins above. Their tests are the ones whose names hold <name>; elsewhere
# they skip, saying where they run.
OWN_VENV_CLIENTS := llamafactory swift verl

.venv-%/.installed: setup.cfg pyproject.toml constraints.txt tests/clients/%-requirements.txt
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --no-compile --constraint constraints.txt --editable '.[test]' \
		--requirement tests/clients/$*-requirements.txt
	touch $@

# Each framework unchanged on two simulated NPUs: plainly, under -m comm, against a reference (tests/clients),
# each in its venv.
test-clients: $(CLIENTS_VENV)/.installed $(OWN_VENV_CLIENTS:%=.venv-%/.installed)
	$(CLIENTS_PY) -m comm.build --simulated
	$(CLIENTS_PY) -m pytest -p no:xdist -q tests/clients
	for name in $(OWN_VENV_CLIENTS); do .venv-$$name/bin/python -m pytest -p no:xdist -q tests/clients -k $$name || exit 1; done

# Peer suites (issue 46): other projects' own distributed tests, unchanged, on two simulated NPUs, plainly and
# under -m comm, and on the CPU (tests/peers), in a venv of their own.
PEERS_VENV := .venv-peers

$(PEERS_VENV)/.installed: setup.cfg pyproject.toml constraints.txt tests/peers/requirements.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --no-compile --constraint constraints.txt --editable '.[test]' \
		--requirement tests/peers/requirements.txt
	touch $@

test-peers: $(PEERS_VENV)/.installed
	$(PEERS_VENV)/bin/python -m comm.build --simulated
	$(PEERS_VENV)/bin/python -m pytest -n 2 -q -rfEs tests/peers

# The real torch_npu (issue 50): the torch-npu wheel that pairs with the pinned torch, unmodified, on comm's fake
# CANN (comm/testing/cann), in a venv of its own; plainly and under comm (tests/real_torch_npu). This pytest runs with
# torch_npu's autoload off: torch would import it, which needs CANN, at its own import; the ranks are on the fake.
# On another release (make test-torch-npu TORCH=2.9.1): that release's venv with the torch-npu wheel that pairs
# with it added (--no-deps: the venv's torch stays), and the tests on the fake alone, not against the simulation.
ifeq ($(TORCH),$(PINNED_TORCH))
TORCH_NPU_VENV := .venv-torch-npu
TORCH_NPU_TESTS :=
else
TORCH_NPU_VENV := $(VENV)
TORCH_NPU_TESTS := -k "not simulated"
endif

.venv-torch-npu/.installed: setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv .venv-torch-npu
	.venv-torch-npu/bin/python -m pip install --quiet --no-compile --constraint constraints.txt --editable '.[test]' \
		"torch-npu==$(PINNED_TORCH).*"
	touch $@

$(VENV)/.torch-npu-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-compile --no-deps "torch-npu==$(TORCH).*" pyyaml
	touch $@

# Then comm's staging tests on hccl groups, their ranks on the real torch_npu (COMM_SIMULATE=cann, which
# python -m comm.testing.cann sets): all but those that read the simulation's own counters or backends, and the
# bool AVG, which the simulated hccl refuses and torch_npu's accepts (docs/simulated-npu.md).
ON_REAL_TORCH_NPU_ONLY := not (synchronises or get_future or pipelined or goes_to_a_backend or is_staged_onto_hccl)

test-torch-npu: $(if $(filter $(TORCH),$(PINNED_TORCH)),.venv-torch-npu/.installed,$(VENV)/.torch-npu-installed)
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(TORCH_NPU_VENV)/bin/python -m comm.build --simulated
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(TORCH_NPU_VENV)/bin/python -m pytest -p no:xdist -q -rfEs tests/real_torch_npu \
		$(TORCH_NPU_TESTS)
	$(TORCH_NPU_VENV)/bin/python -m comm.testing.cann -m pytest -p no:xdist -q tests/test_hccl_staging.py \
		-k "$(ON_REAL_TORCH_NPU_ONLY)"

# Real launchers (issue 36): mpirun (OpenMPI), mpiexec (MPICH), srun and sbatch on a two-node Slurm cluster that
# tests/launchers starts in a folder of its own, torchrun agents; installs the packages once as root (else skips,
# saying why); prints each launch's time.
test-launchers: $(VENV)/.installed
	$(PY) -m comm.build --simulated
	$(PY) -m pytest -p no:xdist -p no:cacheprovider -q -rfEs tests/launchers

# DEMO_ARGS=--no-simulate runs the FSDP2 example on plain CPU gloo.
DEMO_ARGS ?=

demo: $(VENV)/.installed
	@echo "== bind, all-reduce, release the cache: CPU (gloo) =="
	@$(TORCHRUN) examples/bind_and_reduce.py
	@echo "== the same on the simulated NPU (hccl) =="
	@$(TORCHRUN) examples/bind_and_reduce.py --simulate npu
	@echo "== FSDP2 with CPUOffloadPolicy on the simulated NPU: torch's clip fails, then trains once comm equips the group =="
	@$(TORCHRUN) examples/fsdp2_offload_clip.py $(DEMO_ARGS)
	@echo "== a full state dict from CPU-offloaded FSDP2 shards: torch alone, then under python -m comm =="
	@$(TORCHRUN) examples/full_state_dict.py --simulate npu 2>&1 | grep -m1 -o "RuntimeError: No backend type.*" || true
	@$(TORCHRUN) -m comm examples/full_state_dict.py --simulate npu
	@echo "== a DDP trainer written for CUDA, unchanged: torch alone, then under torchrun -m comm on two simulated NPUs =="
	@$(TORCHRUN) examples/cuda_trainer.py 2>&1 | grep -m1 -o -E "AttributeError: module 'torch._C'.*|RuntimeError: Found no NVIDIA driver[^.]*" || true
	@$(TORCHRUN) -m comm --simulate npu examples/cuda_trainer.py

lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff check comm tests examples benchmarks
	$(VENV)/bin/mypy --strict comm

bench: $(VENV)/.installed
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/explicit_call.py
	$(PY) benchmarks/clip_grad.py
	$(PY) benchmarks/compiled.py
	$(PY) benchmarks/translate.py

# On a GPU machine, with the Python that has its CUDA build of torch and pytest
# (a fresh .venv would install the CPU build pinned for CI).
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m pytest -m cuda -p no:xdist -p no:cacheprovider -s -q

# The platform wheel in dist/ (setup.py): comm's C++ built against this venv's torch (TORCH=<release>
# picks the venv), carried in the wheel, which pins that torch. build/ goes first, or setuptools
# would pack files a deleted module left there. The build runs in the venv (it needs its torch), so
# the venv gets pyproject.toml's build requirements (torch 2.9's venv has no wheel package).
wheel: $(VENV)/.installed
	rm -rf build
	$(PY) -m comm.build --simulated
	PIP_CONSTRAINT=$(CONSTRAINTS) $(PY) -m pip install --quiet "setuptools>=61" wheel
	COMM_PREBUILT=1 $(PY) -m pip wheel --no-deps --no-build-isolation --quiet --wheel-dir dist .

# The wheel as a user installs it, with no compiler and no ninja (tests/prebuilt). On another release,
# the fresh venv takes that release's torch from its venv (COMM_TORCH_SITE) instead of installing it again.
test-wheel: wheel
	$(if $(filter $(VENV),.venv),,COMM_TORCH_SITE=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")) \
		$(PY) -m pytest -p no:xdist -p no:cacheprovider -q tests/prebuilt

clean:
	rm -rf .venv .venv-torch* $(CLIENTS_VENV) $(OWN_VENV_CLIENTS:%=.venv-%) *.egg-info .pytest_cache build dist

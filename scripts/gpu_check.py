#!/usr/bin/env python3
"""`make gpu-check`: EPL's checks on this machine's NVIDIA GPUs, one line each.

    python scripts/gpu_check.py              # every check (after `make setup`)
    python scripts/gpu_check.py --preflight  # only: does this machine have a GPU?
    python scripts/gpu_check.py --only dp_oracle recompute_memory

Checks, in this order, each in its own subprocess with its own time limit
(`--check NAME` runs one in this process and prints its result line):

- environment: TensorFlow is built with CUDA and sees the GPUs; every GPU's
  device profile from its real name (epl.planner.profiles.detect_profile: an unknown
  GPU fails here with the message saying how to add a profile); Horovod is
  importable and built with NCCL (scripts/build_horovod.sh on a gpu setup).
- dp_oracle: data parallelism (`epl.replicate`) over the local GPUs; SGD
  steps compared with single-device training on GPU 0.
- split_oracle: a data-parallel body and an `epl.split` classifier (sparse
  softmax cross-entropy over class shards), compared the same way.
- pipeline_oracle: two pipeline stages, 4 micro-batches (1F1B), compared the
  same way.
- fusion_horovod: bench/fusion.py --gpu: 2 Horovod ranks, one GPU each
  (NCCL), EPL's fused gradients against hvd.DistributedOptimizer; its ratio
  line. Needs 2 GPUs: NCCL puts every rank on a GPU of its own.
- dp_overhead: bench/dp_overhead.py --device gpu: EPL against
  tf.distribute.MirroredStrategy over the same GPUs; its ratio line.
- recompute_memory: one training step of a deep MLP on GPU 0 without and
  with `gradient_checkpoint.type: "auto"`; the peak of TensorFlow's GPU
  allocator (tf.config.experimental.get_memory_info) for each, and their
  ratio. Passes when checkpointing lowers the peak.

Devices. With two or more GPUs the multi-device checks use all of them and
EPL's local collectives use NCCL (epl.runtime.communicators). With one GPU
they split it into 2 logical GPUs (`epl.runtime.cluster.use_logical_gpus`), whose
collectives use TensorFlow's ring: NCCL refuses a GPU twice, so local NCCL is
not exercised then, and the result line says so.

Oracles. Float32 matmuls run in full float32 (TensorFlow's TF32 is turned
off in the oracle subprocesses). The tolerance comes from a measured noise
floor: the single-device run is repeated on the same batch with its rows
reversed (the same sums in another order); the error of a run against the
reference is max over variables of max|a - b| / max|b|, and a check passes
when EPL's error is at most 10 x max(noise floor, float32 epsilon). The
reference is single-device training on the batches the replicas consumed,
concatenated (`consumed_batch`: the batch is a constant, which under EPL's
batch contract every replica and micro-batch reads whole, so the concatenation
is copies of it, whose mean loss is the constant's own).

Output: `gpu-check NAME: PASS|FAIL|SKIP (N s) details` per check, then
`gpu-check: P passed, F failed, S skipped`. Exit status 0 when none failed.
On a machine without an NVIDIA GPU (nvidia-smi lists none) it prints
`gpu-check: no NVIDIA GPU on this machine (...)` and exits 1 before running
anything. On one GPU the limits of the checks that run add up to 6.5 minutes
(CHECKS), so the whole run ends within 8 minutes whatever happens.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import select_device  # noqa: E402  (standard library only, like this module's top)

RESULT_TAG = "GPU_CHECK_RESULT "
#: name -> time limit in seconds of its subprocess; on one GPU (fusion_horovod
#: skipped) they add up to 6.5 minutes.
CHECKS = {
    "environment": 60,
    "dp_oracle": 60,
    "split_oracle": 60,
    "pipeline_oracle": 60,
    "fusion_horovod": 120,     # skipped on one GPU
    "dp_overhead": 90,
    "recompute_memory": 60,
}
LOGICAL_GPUS = 2                 # one GPU split for the multi-device checks
LOGICAL_GPU_MEMORY_MB = 4096     # each logical GPU's share (the checks' models are small)
ORACLE_STEPS = 3
TOLERANCE_FACTOR = 10


# ------------------------------------------------------------- preflight --

def no_gpu_message() -> str | None:
    """None where nvidia-smi lists a GPU, else the line saying there is none."""
    gpus, reason = select_device.nvidia_smi_gpus()
    if gpus:
        return None
    return (f"gpu-check: no NVIDIA GPU on this machine ({reason}); the GPU checks "
            f"need one. Nothing was run.")


# ------------------------------------------------------ devices and data --

def setup_devices(cpu_rehearsal: bool) -> dict:
    """Configure the devices of a multi-device check before TensorFlow runs.

    Returns {"config": EPL config entries, "devices": how many, "note": ...}.
    cpu_rehearsal: 2 virtual CPU devices instead (tests run the checks' code
    that way on machines without a GPU).
    """
    import tensorflow as tf

    from epl.runtime.cluster import use_logical_gpus
    if cpu_rehearsal:
        return {"config": {"cluster.virtual_devices": LOGICAL_GPUS}, "devices": LOGICAL_GPUS,
                "note": f"{LOGICAL_GPUS} virtual CPU devices (rehearsal, no GPU)"}
    tf.config.experimental.enable_tensor_float_32_execution(False)
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) == 1:
        use_logical_gpus(LOGICAL_GPUS, LOGICAL_GPU_MEMORY_MB)
        return {"config": {}, "devices": LOGICAL_GPUS,
                "note": f"1 GPU split into {LOGICAL_GPUS} logical GPUs: ring collectives, "
                        f"local NCCL not exercised (needs 2 GPUs)"}
    return {"config": {}, "devices": len(gpus), "note": f"{len(gpus)} GPUs, NCCL collectives"}


def consumed_batch(x, replicas: int):
    """The rows the replicas consumed in one step, concatenated: the batch the
    single-device reference trains on. The checks feed a constant, which every
    replica and micro-batch reads whole (io.batch_mode "replica"): the
    concatenation is `replicas` copies of `x`, whose mean loss and gradients are
    those of `x` itself (one place to change if the checks feed otherwise)."""
    del replicas
    return x


def scaled_error(values, reference) -> float:
    """max over variables of max|a - b| / max|b| (names must agree)."""
    import numpy as np
    if sorted(values) != sorted(reference):
        raise AssertionError(f"variables differ: {sorted(values)} vs {sorted(reference)}")
    return max(float(np.max(np.abs(values[k] - reference[k])) / max(np.max(np.abs(reference[k])),
                                                                   1e-30))
               for k in reference)


def train(build, config: dict | None, x, y, steps: int = ORACLE_STEPS):
    """Build `build(x, y) -> loss` (EPL on when config is not None), run `steps`
    SGD steps; returns ({variable: value}, collective ops' (type, hint))."""
    import tensorflow as tf

    import epl
    from epl import env
    from epl.checkpoint.sharded_variable import full_values
    env.reset()
    if config is not None:
        epl.init(epl.Config(config))
    with tf.Graph().as_default() as graph:
        loss = build(tf.constant(x), tf.constant(y))
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(steps):
                sess.run(train_op)
            values = full_values(sess, graph)
        collectives = sorted({(op.type, op.get_attr("communication_hint").decode())
                              for op in graph.get_operations()
                              if op.type.startswith("Collective")})
    env.reset()
    return values, collectives


def oracle(build, config: dict, x, y, replicas: int) -> dict:
    """EPL training against the single-device reference; the check's result."""
    import numpy as np
    reference, _ = train(build, None, consumed_batch(x, replicas), consumed_batch(y, replicas))
    reordered, _ = train(build, None, x[::-1].copy(), y[::-1].copy())
    noise = scaled_error(reordered, reference)
    values, collectives = train(build, config, x, y)
    error = scaled_error(values, reference)
    tolerance = TOLERANCE_FACTOR * max(noise, float(np.finfo(np.float32).eps))
    kinds = ", ".join(f"{kind}[{hint}]" for kind, hint in collectives) or "none"
    return {"ok": error <= tolerance,
            "details": f"error {error:.2e} (noise floor {noise:.2e}, tolerance {tolerance:.2e}); "
                       f"collectives: {kinds}"}


def _variable(name, shape, seed, scale=None):
    import numpy as np
    import tensorflow as tf
    scale = scale if scale is not None else 1.0 / np.sqrt(shape[0])
    value = (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)
    return tf.compat.v1.get_variable(name, initializer=value)


def _data(batch: int, features: int, classes: int, one_hot: bool, seed: int = 0):
    import numpy as np
    rng = np.random.RandomState(100 + seed)
    x = rng.randn(batch, features).astype(np.float32)
    labels = rng.randint(0, classes, batch)
    return x, (np.eye(classes, dtype=np.float32)[labels] if one_hot else labels.astype(np.int64))


# ---------------------------------------------------------------- checks --

def check_environment(args) -> dict:
    """TensorFlow with CUDA sees the GPUs; their profiles; Horovod with NCCL."""
    import tensorflow as tf

    from epl.planner import profiles
    from epl.errors import ClusterError
    if args.cpu_rehearsal:
        return {"ok": None, "details": f"TensorFlow {tf.__version__}; rehearsal on CPU: no "
                                       f"GPU, profile or Horovod NCCL to check"}
    gpus = tf.config.list_physical_devices("GPU")
    if not tf.test.is_built_with_cuda() or not gpus:
        return {"ok": False, "fatal": True,
                "details": f"TensorFlow {tf.__version__} (built with CUDA: "
                           f"{tf.test.is_built_with_cuda()}) sees {len(gpus)} GPU(s); run "
                           f"`make setup` on this machine (it installs tensorflow[and-cuda] "
                           f"where nvidia-smi finds a GPU, or force it with EPL_DEVICE=gpu)"}
    names, problems = [], []
    for index, gpu in enumerate(gpus):
        details = tf.config.experimental.get_device_details(gpu)
        model = details.get("device_name", "")
        try:
            profile = profiles.detect_profile(f"/device:GPU:{index}", model).name
        except ClusterError as err:
            profile = "unknown"
            problems.append(str(err))
        capability = ".".join(str(c) for c in details.get("compute_capability", ()))
        names.append(f"GPU:{index} {model} (sm {capability}) -> {profile}")
    try:
        import horovod
        import horovod.tensorflow as hvd
        horovod_line = f"Horovod {horovod.__version__} NCCL built: {bool(hvd.nccl_built())}"
        if not hvd.nccl_built():
            problems.append("Horovod is not built with NCCL: run `make setup` on this machine")
    except ImportError as err:
        horovod_line = f"Horovod not importable ({err})"
        problems.append(horovod_line)
    return {"ok": not problems,
            "details": f"TensorFlow {tf.__version__}; {'; '.join(names)}; {horovod_line}"
                       + (f"; problems: {' | '.join(problems)}" if problems else "")}


def check_dp_oracle(args) -> dict:
    import tensorflow as tf

    import epl
    setup = setup_devices(args.cpu_rehearsal)
    batch = 16 * setup["devices"]
    x, y = _data(batch, 32, 8, one_hot=True)

    def build(features, labels):
        with epl.replicate(device_count=1) if _epl_on() else _nothing():
            h = tf.nn.relu(tf.matmul(features, _variable("w1", [32, 64], 1)))
            h = tf.nn.relu(tf.matmul(h, _variable("w2", [64, 64], 2)))
            logits = tf.matmul(h, _variable("w3", [64, 8], 3))
            return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels,
                                                                          logits=logits))
    result = oracle(build, setup["config"], x, y, setup["devices"])
    result["details"] = f"{setup['devices']} replicas on {setup['note']}; " + result["details"]
    return result


def check_split_oracle(args) -> dict:
    import tensorflow as tf

    import epl
    import epl.layers as layers
    setup = setup_devices(args.cpu_rehearsal)
    k = setup["devices"]
    classes = 64 * k
    x, y = _data(16 * k, 32, classes, one_hot=False)
    config = {**setup["config"], "cluster.colocate_split_and_replicate": True}

    def build(features, labels):
        on = _epl_on()
        with epl.replicate(1, name="body") if on else _nothing():
            h = tf.nn.relu(tf.matmul(features, _variable("body", [32, 64], 1)))
        with epl.split(k, name="classifier") if on else _nothing():
            logits = layers.dense(h, classes, use_bias=False, name="classifier",
                                  kernel_initializer=tf.constant_initializer(
                                      _numpy_init([64, classes], 2)))
            return layers.sparse_softmax_cross_entropy(labels, logits)
    result = oracle(build, config, x, y, k)
    result["details"] = f"split over {k} devices ({setup['note']}); " + result["details"]
    return result


def check_pipeline_oracle(args) -> dict:
    import tensorflow as tf

    import epl
    setup = setup_devices(args.cpu_rehearsal)
    config = {**setup["config"], "pipeline.num_micro_batch": 4}
    x, y = _data(32, 32, 8, one_hot=True)

    def build(features, labels):
        on = _epl_on()
        with epl.replicate(1, name="stage_0") if on else _nothing():
            h = tf.nn.relu(tf.matmul(features, _variable("w1", [32, 64], 1)))
            h = tf.nn.relu(tf.matmul(h, _variable("w2", [64, 64], 2)))
        with epl.replicate(1, name="stage_1") if on else _nothing():
            h = tf.nn.relu(tf.matmul(h, _variable("w3", [64, 64], 3)))
            logits = tf.matmul(h, _variable("w4", [64, 8], 4))
            return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=labels,
                                                                          logits=logits))
    result = oracle(build, config, x, y, setup["devices"] // 2)
    result["details"] = (f"2 stages x 4 micro-batches, {setup['devices'] // 2} pipeline(s) on "
                         f"{setup['note']}; " + result["details"])
    return result


def _run_bench(command: list[str], marker: str, timeout_s: float) -> dict:
    """Run a benchmark script; its last line containing `marker` is the result."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout_s, env=env)
    lines = [line for line in result.stdout.splitlines() if marker in line]
    if result.returncode != 0 or not lines:
        tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        return {"ok": False, "details": f"{' '.join(command)} exited {result.returncode}: "
                                        f"{' | '.join(tail)}"}
    return {"ok": True, "details": lines[-1].strip()}


def check_fusion_horovod(args) -> dict:
    if args.cpu_rehearsal:
        return _run_bench(["bench/fusion.py", "--quick"], "fusion:", CHECKS["fusion_horovod"] - 5)
    import tensorflow as tf
    gpus = len(tf.config.list_physical_devices("GPU"))
    if gpus < 2:
        return {"ok": None, "details": f"needs 2 GPUs, found {gpus}: NCCL puts each Horovod "
                                       f"rank on a GPU of its own"}
    return _run_bench(["bench/fusion.py", "--gpu", "--steps", "30", "--repeats", "1"], "fusion:",
                      CHECKS["fusion_horovod"] - 5)


def check_dp_overhead(args) -> dict:
    device = "cpu" if args.cpu_rehearsal else "gpu"
    return _run_bench(["bench/dp_overhead.py", "--device", device, "--quick"],
                      "dp_overhead: EPL/MirroredStrategy", CHECKS["dp_overhead"] - 5)


def check_recompute_memory(args) -> dict:
    if args.cpu_rehearsal:
        return {"ok": None, "details": "TensorFlow's CPU allocator keeps no peak; GPU only"}
    peaks = {}
    for side in ("baseline", "auto"):
        command = [os.path.abspath(__file__), "--memory-side", side]
        first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        result = subprocess.run([sys.executable, *command], capture_output=True, text=True,
                                timeout=(CHECKS["recompute_memory"] - 5) / 2,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                                         CUDA_VISIBLE_DEVICES=first_gpu))
        lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_TAG)]
        if result.returncode != 0 or not lines:
            tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
            return {"ok": False, "details": f"{side}: exit {result.returncode}: {' | '.join(tail)}"}
        peaks[side] = json.loads(lines[-1][len(RESULT_TAG):])["peak"]
    if peaks["baseline"] <= 0:
        return {"ok": False, "details": "TensorFlow's GPU allocator reported no peak"}
    ratio = peaks["auto"] / peaks["baseline"]
    return {"ok": ratio < 1.0,
            "details": f"allocator peak of one step: baseline {peaks['baseline'] / 2**20:.0f} MiB, "
                       f"gradient_checkpoint auto {peaks['auto'] / 2**20:.0f} MiB, "
                       f"ratio {ratio:.2f}"}


def memory_side(side: str) -> None:
    """One step of a 32-layer MLP on one GPU; print its allocator peak (subprocess,
    which sees only that GPU: EPL would otherwise replicate over every GPU)."""
    import tensorflow as tf

    import epl
    layers, width, batch = 32, 2048, 8192
    epl.init(epl.Config({"gradient_checkpoint.type": "auto"} if side == "auto" else {}))
    import numpy as np
    batch_values = np.random.RandomState(1).randn(batch, width).astype(np.float32)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, width])
        with epl.replicate(device_count=1):
            h = x
            for i in range(layers):
                h = tf.nn.relu(tf.matmul(h, _variable(f"w{i}", [width, width], i)))
            loss = tf.reduce_mean(tf.square(h))
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
        # The eager context's GPU devices first: the session then shares their
        # allocator (TensorFlow keeps one per GPU and process), whose peak is read.
        tf.config.experimental.reset_memory_stats("GPU:0")
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            tf.config.experimental.reset_memory_stats("GPU:0")
            sess.run(train_op, {x: batch_values})
            peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
    print(RESULT_TAG + json.dumps({"peak": peak}), flush=True)


def _numpy_init(shape, seed):
    import numpy as np
    return (np.random.RandomState(seed).randn(*shape) / np.sqrt(shape[0])).astype(np.float32)


def _epl_on() -> bool:
    """Whether EPL is initialized (the EPL run) or not (the reference)."""
    from epl import env
    return env.is_initialized()


class _nothing:
    """A context manager doing nothing (the reference run has no EPL scopes)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


CHECK_FUNCTIONS = {
    "environment": check_environment, "dp_oracle": check_dp_oracle,
    "split_oracle": check_split_oracle, "pipeline_oracle": check_pipeline_oracle,
    "fusion_horovod": check_fusion_horovod, "dp_overhead": check_dp_overhead,
    "recompute_memory": check_recompute_memory,
}


# ---------------------------------------------------------------- driver --

def run_check_here(name: str, args) -> None:
    """Run one check in this process and print its result line (JSON)."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    try:
        result = CHECK_FUNCTIONS[name](args)
    except Exception as err:  # a failing check reports, the others still run
        result = {"ok": False, "details": f"{type(err).__name__}: {err}"}
    print(RESULT_TAG + json.dumps(result), flush=True)


def run_check(name: str, args) -> dict:
    """Run one check in a subprocess within its time limit; its result."""
    command = [sys.executable, os.path.abspath(__file__), "--check", name]
    if args.cpu_rehearsal:
        command.append("--cpu-rehearsal")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=CHECKS[name],
                                env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"ok": False, "details": f"did not finish within {CHECKS[name]} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if not lines:
        tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        return {"ok": False, "details": f"exit {result.returncode} without a result: "
                                        f"{' | '.join(tail)}"}
    return json.loads(lines[-1][len(RESULT_TAG):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preflight", action="store_true",
                        help="only say whether this machine has an NVIDIA GPU")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run these checks")
    parser.add_argument("--check", choices=list(CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--memory-side", choices=["baseline", "auto"], help=argparse.SUPPRESS)
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run the checks' code on virtual CPU devices (for tests)")
    args = parser.parse_args(argv)
    if args.check:
        run_check_here(args.check, args)
        return 0
    if args.memory_side:
        memory_side(args.memory_side)
        return 0
    if not args.cpu_rehearsal:
        message = no_gpu_message()
        if message:
            print(message, flush=True)
            return 1
    if args.preflight:
        return 0
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    fatal = None
    for name in args.only or list(CHECKS):
        start = time.perf_counter()
        if fatal:
            result = {"ok": None, "details": f"not run: {fatal} failed"}
        else:
            result = run_check(name, args)
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[result["ok"]]
        counts[status] += 1
        print(f"gpu-check {name}: {status} ({time.perf_counter() - start:.0f} s) "
              f"{result['details']}", flush=True)
        if result.get("fatal"):
            fatal = name
    print(f"gpu-check: {counts['PASS']} passed, {counts['FAIL']} failed, "
          f"{counts['SKIP']} skipped", flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())

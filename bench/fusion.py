"""Communication fusion: EPL fused vs EPL unfused vs Horovod DistributedOptimizer.

Two workers (horovodrun --gloo on localhost), one device each, a model with 200
small variables (so per-tensor communication cost dominates). Three sides,
measured in one run of this script, each as its own 2-worker job:
- epl_fused:   EPL data parallelism, default fusion (128 MB buckets: 1 bucket)
- epl_unfused: EPL with communication.fusion_threshold_mb tiny (200 all-reduces)
The EPL sides run with Horovod's runtime fusion off (HOROVOD_FUSION_THRESHOLD=0),
so "unfused" really issues one all-reduce per gradient and "fused" measures
EPL's own buckets; the Horovod side keeps its default runtime fusion.
- horovod:     plain TF + hvd.DistributedOptimizer (Horovod's runtime tensor fusion)
Each worker times N steps after warm-up; rank 0 reports the median step time.

    python bench/fusion.py [--steps 60] [--repeats 3] [--vars 200]
    python bench/fusion.py --gpu   # one GPU per worker (CUDA_VISIBLE_DEVICES from the
                                   # local rank): Horovod all-reduces GPU tensors with NCCL
Prints: fusion: EPL fused / unfused = X (target <= 0.6); EPL fused / Horovod = Y (target <= 1.0)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SIDES = ("epl_fused", "epl_unfused", "horovod")


def worker(side: str, steps: int, num_vars: int, out: str, gpu: bool = False) -> None:
    """One worker of one side: build, warm up, time `steps` steps (on the GPU of its
    local rank with `gpu`)."""
    if gpu:  # before TensorFlow starts: this worker sees only its own GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HOROVOD_LOCAL_RANK"]
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    rng = np.random.RandomState(0)
    x_np = rng.randn(32, 64).astype(np.float32)
    if side.startswith("epl"):
        import epl
        config = {"cluster.virtual_devices": 1}
        if side == "epl_unfused":
            config["communication.fusion_threshold_mb"] = 1e-6
            config["communication.max_splits"] = 0   # no cap: one all-reduce per gradient
        epl.init(epl.Config(config))
        rank = epl.Cluster.current().worker_rank
    else:
        import horovod.tensorflow as hvd
        hvd.init()
        rank = hvd.rank()
    x = tf.constant(x_np)
    h = x
    variables = []
    for i in range(num_vars):  # a deep stack of tiny residual layers: 200 small variables
        v = tf.compat.v1.get_variable(f"v{i}", initializer=np.full([64], 0.01, np.float32))
        variables.append(v)
        h = h + tf.nn.tanh(h * v)
    loss = tf.reduce_mean(tf.square(h))
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)
    if side == "horovod":
        import horovod.tensorflow as hvd
        opt = hvd.DistributedOptimizer(opt)
    train = opt.minimize(loss)
    hooks_init = []
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        if side == "horovod":
            sess.run(hvd.broadcast_global_variables(0))
        for _ in range(10):
            sess.run(train)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            sess.run(train)
            times.append(time.perf_counter() - start)
    del hooks_init
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"median_s": statistics.median(times)}, f)


def run_side(side: str, steps: int, num_vars: int, gpu: bool = False) -> float:
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
                   os.path.abspath(__file__), "--worker", side, "--steps", str(steps),
                   "--vars", str(num_vars), "--out", out] + (["--gpu"] if gpu else [])
        env = dict(os.environ)
        if side.startswith("epl"):
            env["HOROVOD_FUSION_THRESHOLD"] = "0"
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        if result.returncode != 0:
            raise SystemExit(f"{side} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["median_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="EPL fusion vs Horovod DistributedOptimizer")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vars", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="tiny settings (smoke test)")
    parser.add_argument("--gpu", action="store_true",
                        help="one GPU per worker (needs 2 GPUs; Horovod uses NCCL)")
    parser.add_argument("--worker", choices=SIDES)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.vars, args.out, args.gpu)
        return 0
    if args.quick:
        args.steps, args.repeats, args.vars = 5, 1, 20
    results = {side: [] for side in SIDES}
    for _ in range(args.repeats):  # interleave sides so machine noise hits all alike
        for side in SIDES:
            results[side].append(run_side(side, args.steps, args.vars, args.gpu))
    medians = {side: statistics.median(v) for side, v in results.items()}
    for side in SIDES:
        print(f"{side:12s} median step {medians[side] * 1e3:8.2f} ms  (runs: "
              f"{', '.join(f'{t * 1e3:.2f}' for t in results[side])})")
    fused_vs_unfused = medians["epl_fused"] / medians["epl_unfused"]
    fused_vs_horovod = medians["epl_fused"] / medians["horovod"]
    print("workers: 2, one GPU each (Horovod over NCCL)" if args.gpu
          else "workers: 2 on CPU (Horovod over Gloo)")
    print(f"fusion: EPL fused / EPL unfused = {fused_vs_unfused:.2f} (target <= 0.6); "
          f"EPL fused / Horovod DistributedOptimizer = {fused_vs_horovod:.2f} (target <= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gradient checkpointing (peak memory and step time of one step) and ZeRO (optimizer state).

Builds a deep model in plain TensorFlow (no EPL: this measures the algorithm
in epl/passes/recompute/checkpoints.py, not the passes around it) and runs one training step
(gradients + SGD apply) two ways, each in its own subprocess:

- baseline:      tf.compat.v1.gradients(loss, variables)
- checkpointed:  checkpointed_gradients(loss, variables,
                                        select_checkpoints_auto(loss, variables))

Per side it reports
- activation memory: the peak of the bytes allocated during one step, from
  TensorFlow's allocation records (RunOptions(trace_level=FULL_TRACE);
  RunMetadata.step_stats: every node's memory[].allocation_records, +bytes at
  allocation and -bytes at deallocation, summed in time order over the whole
  step; allocations first at equal timestamps). Variables are allocated
  before the step and are not counted; activations, gradients and
  temporaries are;
- allocator peak: the largest allocator_bytes_in_use seen in the records
  (everything live in the CPU allocator, variables included);
- RSS: process peak RSS (resource.getrusage ru_maxrss) minus the RSS just
  before the first step (after building and initializing);
- step time: the median of --steps untraced steps (after one warm-up step).
  The ratio in the summary line comes from a third subprocess that holds
  both sides and alternates their steps: the ratio of the fastest step of
  each side (on a shared CPU other processes only ever add time; the
  median of the per-pair ratios is printed too).

Prints one line per side, the ratios and
  memory: activation memory with checkpointing = X.XX x baseline (target <= 0.35)
          at Y.YY x step time (target <= 1.35)          [one line]

ZeRO (a fourth subprocess): the same model under EPL with Adam on
--zero-replicas virtual CPU devices, parallelized without and with
`zero.level: "v1"`; the optimizer-state bytes per replica are read from the
placed graph (epl.passes.zero.optimizer_state_bytes), and
  zero: optimizer-state bytes per replica with ZeRO = R.RRR x replicated Adam (target 1/N)

Usage:
  python bench/memory.py            # 24-layer transformer (the full run)
  python bench/memory.py --quick    # a small smoke test
  python bench/memory.py --model mlp
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

MEMORY_TARGET = 0.35
TIME_TARGET = 1.35


def _spec(args):
    import common
    if args.model == "mlp":
        return common.MLPSpec(input_dim=args.width, width=args.width, layers=args.layers,
                              classes=10)
    return common.TransformerSpec(layers=args.layers, hidden=args.width, heads=args.heads,
                                  ffn=4 * args.width, seq=args.seq, vocab=0,
                                  input_dim=args.width, classes=10)


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _allocation_peaks(run_metadata) -> tuple[int, int]:
    """(peak of step allocations, max allocator bytes in use) over all devices."""
    records, in_use = [], 0
    for dev in run_metadata.step_stats.dev_stats:
        for node in dev.node_stats:
            for mem in node.memory:
                in_use = max(in_use, mem.allocator_bytes_in_use)
                records.extend((r.alloc_micros, -r.alloc_bytes) for r in mem.allocation_records)
    records.sort()
    live = peak = 0
    for _, negative_bytes in records:
        live -= negative_bytes
        peak = max(peak, live)
    return peak, in_use


def _build(args, side: str):
    """(graph, loss, train_op, init, feed, #checkpoints, seconds to build the gradients)."""
    import tensorflow as tf
    import common
    from epl.passes.recompute import checkpoints as recompute

    spec = _spec(args)
    params_fn, loss_fn, batch_fn = common.model_fns(spec)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        inputs, labels = common.input_placeholders(spec, None if args.dynamic else args.batch)
        params = params_fn(spec, common.v1_variable)
        loss = loss_fn(spec, params, inputs, labels)
        variables = list(params.values())
        start = time.perf_counter()
        checkpoints = []
        if side == "checkpointed":
            checkpoints = recompute.select_checkpoints_auto(loss, variables)
            grads = recompute.checkpointed_gradients(loss, variables, checkpoints,
                                                     gate_gradients=True)
        else:
            grads = tf.compat.v1.gradients(loss, variables, gate_gradients=True)
        build_s = time.perf_counter() - start
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).apply_gradients(
            zip(grads, variables))
        init = tf.compat.v1.global_variables_initializer()
    x, y = batch_fn(spec, args.batch)
    return graph, loss, train_op, init, {inputs: x, labels: y}, len(checkpoints), build_s


def _session(args, graph):
    import tensorflow as tf
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=args.threads,
                                      inter_op_parallelism_threads=args.threads)
    return tf.compat.v1.Session(graph=graph, config=config)


def worker(args) -> dict:
    """One side in this process: memory (allocation records, RSS) and step time."""
    import tensorflow as tf
    import common

    graph, loss, train_op, init, feed, checkpoints, build_s = _build(args, args.side)
    with _session(args, graph) as sess:
        sess.run(init)
        rss_before = _rss_now()
        sess.run(train_op, feed)                       # warm-up
        metadata = tf.compat.v1.RunMetadata()
        sess.run(train_op, feed, run_metadata=metadata,
                 options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
        step_peak, allocator_peak = _allocation_peaks(metadata)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            sess.run(train_op, feed)
            times.append(time.perf_counter() - start)
        final_loss = float(sess.run(loss, feed))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"side": args.side, "step_peak": step_peak, "allocator_peak": allocator_peak,
            "rss_delta": peak_rss - rss_before, "peak_rss": peak_rss,
            "step_s": common.median(times), "build_s": build_s,
            "checkpoints": checkpoints, "ops": len(graph.get_operations()),
            "loss": final_loss}


def timing_worker(args) -> dict:
    """Both sides in one process, steps alternated (robust to a shared, drifting CPU)."""
    import common

    sides = {}
    for side in ("baseline", "checkpointed"):
        graph, _, train_op, init, feed, _, _ = _build(args, side)
        sess = _session(args, graph)
        sess.run(init)
        sess.run(train_op, feed)                       # warm-up
        sides[side] = (sess, train_op, feed)
    times = {side: [] for side in sides}
    for _ in range(args.steps):
        for side, (sess, train_op, feed) in sides.items():
            start = time.perf_counter()
            sess.run(train_op, feed)
            times[side].append(time.perf_counter() - start)
    for sess, _, _ in sides.values():
        sess.close()
    ratios = [c / b for b, c in zip(times["baseline"], times["checkpointed"])]
    return {"side": "timing", "baseline_s": min(times["baseline"]),
            "checkpointed_s": min(times["checkpointed"]),
            "ratio": min(times["checkpointed"]) / min(times["baseline"]),
            "pair_ratio": common.median(ratios)}


def zero_worker(args) -> dict:
    """Adam's optimizer-state bytes per replica, replicated and with ZeRO (zero.level v1).

    The same model under EPL on --zero-replicas virtual CPU devices, parallelized
    twice; the bytes come from the placed graph (epl.passes.zero.optimizer_state_bytes:
    the optimizer-state variables a step reads, by device).
    """
    import tensorflow as tf
    import common
    import epl
    from epl import env
    from epl.passes.zero import optimizer_state_bytes

    tf.compat.v1.enable_resource_variables()  # ZeRO shards resource variables
    spec = _spec(args)
    params_fn, loss_fn, _ = common.model_fns(spec)
    sides = {}
    for level in ("", "v1"):
        env.reset()
        epl.init(epl.Config({"cluster.virtual_devices": args.zero_replicas, "zero.level": level}))
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.set_random_seed(0)
            inputs, labels = common.input_placeholders(spec, args.batch)
            with epl.replicate(device_count=1):
                params = params_fn(spec, common.v1_variable)
                loss = loss_fn(spec, params, inputs, labels)
            train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
            param_bytes = sum(v.shape.num_elements() * v.dtype.size for v in params.values())
            start = time.perf_counter()
            epl.parallelize(graph)
            sides["zero" if level else "replicated"] = {
                "per_device": optimizer_state_bytes(graph, [train_op]),
                "parallelize_s": time.perf_counter() - start}
        env.reset()
    replicated, zero = (max(sides[k]["per_device"].values()) for k in ("replicated", "zero"))
    return {"side": "zero", "replicas": args.zero_replicas, "param_bytes": param_bytes,
            "replicated_bytes": replicated, "zero_bytes": zero, "ratio": zero / replicated,
            "devices": len(sides["zero"]["per_device"]), **sides}


def _run_side(args, side: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--side", side, "--model", args.model,
               "--layers", str(args.layers), "--width", str(args.width), "--batch",
               str(args.batch), "--seq", str(args.seq), "--heads", str(args.heads),
               "--steps", str(args.steps), "--threads", str(args.threads),
               "--zero-replicas", str(args.zero_replicas)]
    if args.dynamic:
        command.append("--dynamic")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv=None) -> dict:
    """Run the benchmark (or one side of it, with --side); return the ratios and results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("transformer", "mlp"), default="transformer")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=128,
                        help="hidden size (transformer; ffn = 4x) or MLP width")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=9, help="timed steps per side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small model, smoke test")
    parser.add_argument("--dynamic", action="store_true",
                        help="placeholders with an unknown batch dimension")
    parser.add_argument("--zero-replicas", type=int, default=4,
                        help="data-parallel replicas (virtual CPU devices) of the ZeRO comparison")
    parser.add_argument("--side", choices=("baseline", "checkpointed", "timing", "zero"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.batch, args.seq, args.steps = 6, 32, 8, 16, 2
    if args.side:
        result = {"timing": timing_worker, "zero": zero_worker}.get(args.side, worker)(args)
        print(json.dumps(result), flush=True)
        return result
    what = (f"{args.model}: {args.layers} layers, width {args.width}, batch {args.batch}"
            + (f", seq {args.seq}, {args.heads} heads" if args.model == "transformer" else "")
            + f"; {args.threads} threads, median of {args.steps} steps")
    print(f"memory benchmark ({what})")
    results = {side: _run_side(args, side)
               for side in ("baseline", "checkpointed", "timing", "zero")}
    timing, zero = results.pop("timing"), results.pop("zero")
    for side, r in results.items():
        print(f"  {side:12s} activation peak {_mb(r['step_peak']):>11s}  allocator peak "
              f"{_mb(r['allocator_peak']) if r['allocator_peak'] else 'n/a':>11s}  "
              f"RSS +{_mb(r['rss_delta']):>11s} "
              f"(peak {_mb(r['peak_rss'])})  step {r['step_s'] * 1e3:8.1f} ms  "
              f"{r['checkpoints']} checkpoints  {r['ops']} ops  gradients built in "
              f"{r['build_s']:.2f} s")
    base, ckpt = results["baseline"], results["checkpointed"]
    memory = ckpt["step_peak"] / max(base["step_peak"], 1)
    rss = ckpt["rss_delta"] / max(base["rss_delta"], 1)
    step = timing["ratio"]
    print(f"  step time, both sides in one process, {args.steps} steps each alternated: "
          f"fastest baseline {timing['baseline_s'] * 1e3:.1f} ms, fastest checkpointed "
          f"{timing['checkpointed_s'] * 1e3:.1f} ms, ratio {step:.2f} "
          f"(median of the per-pair ratios {timing['pair_ratio']:.2f})")
    allocator = (f"{ckpt['allocator_peak'] / base['allocator_peak']:.2f} x"
                 if base["allocator_peak"] else "n/a (not reported)")
    print(f"  RSS growth during the step: {rss:.2f} x baseline; allocator peak {allocator}")
    print(f"memory: activation memory with checkpointing = {memory:.2f} x baseline "
          f"(target <= {MEMORY_TARGET}) at {step:.2f} x step time (target <= {TIME_TARGET})")
    print(f"  Adam optimizer state per replica over {zero['replicas']} replicas (placed graph, "
          f"{_mb(zero['param_bytes'])} of parameters): replicated "
          f"{_mb(zero['replicated_bytes'])}, ZeRO {_mb(zero['zero_bytes'])}")
    print(f"zero: optimizer-state bytes per replica with ZeRO = {zero['ratio']:.3f} x replicated "
          f"Adam (target 1/{zero['replicas']} = {1 / zero['replicas']:.3f})")
    return {"memory": memory, "rss": rss, "step": step, **results, "timing": timing,
            "zero": zero}


if __name__ == "__main__":
    main()

"""Cost of EPL's rewrite: the pass pipeline's time against TensorFlow's graph build.

For transformers of 6, 12 and 24 layers (hidden 64, seq 16, batch 8, Adam):

- build: the time TensorFlow takes to build the training graph (model, then
  `AdamOptimizer.minimize`) in a fresh `tf.Graph`, plain TensorFlow (EPL not
  initialized). This is the denominator of the ratio.
- epl build: the same graph built under `epl.replicate(device_count=1)` with
  EPL initialized (what the passes then rewrite), for reference.
- passes: the wall time of `epl.parallelize(g)` on that graph with
  `--devices` virtual devices (analysis, planning and every pass), and the
  per-pass durations EPL recorded (`ParallelGraph.timings`).
- ops in / out: op counts before and after the rewrite; ops/s: ops in the
  input graph per second of pass time.

Each cell is the median of `--repeats` runs; the plain build, the EPL build
and the passes of a model follow each other inside each run, and the ratio
passes/build is the median over runs of that run's ratio, so that load drift
between runs on a shared machine cancels. The linearity check divides the
pass time per input op at the largest model by that at the smallest (1.0 =
linear in graph size).

Last line: `rewrite_cost: ratio passes/build = R (6L) R (12L) R (24L); target <= 0.5`.

    python bench/rewrite_cost.py            # 6, 12, 24 layers, 2 devices, 3 runs
    python bench/rewrite_cost.py --devices 4
    python bench/rewrite_cost.py --quick    # 1 and 2 layers, 1 run, no warm-up (smoke test)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

import epl  # noqa: E402
from common import (TransformerSpec, format_table, input_placeholders, median, timed,  # noqa: E402
                    transformer_loss, transformer_params, v1_variable)

TARGET = 0.5


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=0,
                        help="embedding table size (0: dense input projection)")
    parser.add_argument("--devices", type=int, default=2, help="virtual devices (replicas)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smallest settings (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.repeats, args.devices = [1, 2], 1, 2
    return args


def build_training_graph(spec: TransformerSpec, batch: int, annotate: bool) -> tf.Graph:
    """A fresh graph holding the transformer, its loss and an Adam minimize step.

    annotate: build the model under `epl.replicate(device_count=1)` (EPL must be
    initialized); otherwise plain TensorFlow.
    """
    graph = tf.Graph()
    with graph.as_default():
        inputs, labels = input_placeholders(spec, batch)
        if annotate:
            with epl.replicate(device_count=1):
                loss = transformer_loss(spec, transformer_params(spec, v1_variable), inputs, labels)
        else:
            loss = transformer_loss(spec, transformer_params(spec, v1_variable), inputs, labels)
        tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
    return graph


def measure_once(spec: TransformerSpec, batch: int, devices: int) -> dict:
    """One run: plain build, EPL build and parallelize of one model."""
    epl.env.reset()
    build_s, _ = timed(lambda: build_training_graph(spec, batch, annotate=False))
    epl.init(epl.Config({"cluster.virtual_devices": devices,
                         "communication.sparse_as_dense": bool(spec.vocab)}))
    try:
        epl_build_s, graph = timed(lambda: build_training_graph(spec, batch, annotate=True))
        ops_in = len(graph.get_operations())
        pass_s, result = timed(lambda: epl.parallelize(graph))
        ops_out = len(graph.get_operations())
    finally:
        epl.env.reset()
    if result.plan.num_replicas != devices:
        raise RuntimeError(f"expected {devices} replicas, the plan has {result.plan.num_replicas}")
    return {"build_s": build_s, "epl_build_s": epl_build_s, "pass_s": pass_s,
            "ops_in": ops_in, "ops_out": ops_out, "timings": dict(result.timings)}


def measure(spec: TransformerSpec, batch: int, devices: int, repeats: int) -> dict:
    """Medians over `repeats` runs of measure_once."""
    runs = [measure_once(spec, batch, devices) for _ in range(repeats)]
    passes = list(dict.fromkeys(name for run in runs for name in run["timings"]))
    summary = {key: median([run[key] for run in runs]) for key in ("build_s", "epl_build_s", "pass_s")}
    summary.update({key: runs[0][key] for key in ("ops_in", "ops_out")})  # the same every run
    summary["timings"] = {name: median([run["timings"].get(name, 0.0) for run in runs]) for name in passes}
    summary["ratio"] = median([run["pass_s"] / run["build_s"] for run in runs])  # paired per run
    return summary


def main(argv=None) -> dict:
    """Run the benchmark, print the table and the ratio line; return the results by layer count."""
    args = parse_args(argv)
    specs = {n: TransformerSpec(layers=n, hidden=args.hidden, heads=args.heads, ffn=4 * args.hidden,
                                seq=args.seq, vocab=args.vocab) for n in args.layers}
    if not args.quick:  # warm-up: the first graph of a process pays for lazy imports and caches
        measure_once(dataclasses.replace(specs[args.layers[0]], layers=1), args.batch, args.devices)
    results = {n: measure(spec, args.batch, args.devices, args.repeats) for n, spec in specs.items()}

    print(f"rewrite_cost: transformer hidden={args.hidden} heads={args.heads} seq={args.seq} "
          f"batch={args.batch} vocab={args.vocab or 'dense input'}, Adam, {args.devices} virtual "
          f"devices, median of {args.repeats} run(s); TensorFlow {tf.__version__}")
    rows = []
    for n, r in results.items():
        rows.append([f"{n}L", r["ops_in"], r["ops_out"], r["build_s"], r["epl_build_s"], r["pass_s"],
                     sum(r["timings"].values()), r["ops_in"] / r["pass_s"],
                     1e6 * r["pass_s"] / r["ops_in"], r["ratio"]])
    print(format_table(["model", "ops in", "ops out", "build s", "epl build s", "passes s",
                        "sum(pass) s", "ops/s", "us/op", "passes/build"], rows))
    pass_names = list(next(iter(results.values()))["timings"])
    print("\nper-pass seconds (median):")
    print(format_table(["model"] + pass_names + ["outside passes"],
                       [[f"{n}L"] + [r["timings"].get(p, 0.0) for p in pass_names]
                        + [r["pass_s"] - sum(r["timings"].values())] for n, r in results.items()]))
    small, large = results[min(results)], results[max(results)]
    linearity = (large["pass_s"] / large["ops_in"]) / (small["pass_s"] / small["ops_in"])
    build_linearity = (large["build_s"] / large["ops_in"]) / (small["build_s"] / small["ops_in"])
    print(f"\nlinearity: pass time per op at {max(results)}L / at {min(results)}L = {linearity:.2f} "
          f"(1.00 = linear; TensorFlow's build: {build_linearity:.2f})")
    ratios = " ".join(f"{r['ratio']:.2f} ({n}L)" for n, r in results.items())
    print(f"rewrite_cost: ratio passes/build = {ratios}; target <= {TARGET}")
    return results


if __name__ == "__main__":
    main()

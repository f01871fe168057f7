"""Start-up cost of EPL against plain TensorFlow: ops, rewrite, first step, steady step, peak RSS.

The model is `examples/bert_pipeline.py`'s BERT-style encoder (token and
position embeddings, L pre-layer-norm transformer layers, a masked-token head,
Adam; hidden 64, 4 heads, vocab 64, sequence 16, 2 masked positions) fed from
its tf.data pipeline (a one-shot iterator). Configurations:

- pipeline, for each L in `--layers` and M in `--micro-batches`: the
  embeddings and the first L/2 layers under
  `epl.replicate(device_count=1, name="stage_0")`, the rest and the head under
  `name="stage_1"`, 2 virtual CPU devices (`cluster.virtual_devices: 2`),
  `pipeline.num_micro_batch: M`, micro-batch `--batch` rows (4): a step trains
  on M x 4 rows.
- data parallelism, for each L: the whole model under one
  `epl.replicate(device_count=1)` on `--dp-replicas` (4) virtual CPU devices;
  every replica draws its own `--batch` rows: a step trains on 4 x 4 rows.

Each is measured twice: "epl" (EPL initialized, the scopes above, rewritten by
`epl.parallelize`) and "plain" (EPL not initialized, no scopes, one device,
the iterator drawing the whole global batch at once: M x 4 or replicas x 4
rows): the same model trained on the same global batch by plain TensorFlow.

Every (configuration, side) runs in its own fresh Python process (virtual
devices are fixed per process, and the peak RSS is per process); EPL and plain
processes of one configuration follow each other (their order alternates
between repeats), the configurations are repeated `--repeats` times, and each
figure is the median over the repeats. What each figure measures, inside the
child process:

- ops in: operations in the graph once the model, the loss and Adam's
  minimize step are built (before `epl.parallelize`, before any session).
- ops out: operations after `epl.parallelize` (plain: = ops in). With the
  unit_functions pass the copies it replaced by function calls stay in the
  graph, unread (TensorFlow's graph API removes no op), so this counts them.
- step ops: the ops a training step runs (the train op and what it reads or
  waits for, as the session prunes the graph before optimizing it) plus the
  nodes of every library function they call, once per function: what
  TensorFlow's first step optimizes, places and instantiates.
- build s: building that graph (for reference; not in the ratios).
- rewrite s: the wall time of the `epl.parallelize(graph)` call (plain: 0).
- first step s: `tf.compat.v1.global_variables_initializer()`, creating the
  `tf.compat.v1.Session`, running the initializer and running the first
  training step (TensorFlow's graph optimization, placement and executor
  creation happen here); plain's first step includes its own session
  creation and initialization in the same way.
- steady s: the median of `--steps` training steps after the first.
- peak RSS MB: the process's peak resident set (VmHWM of /proc/self/status,
  ru_maxrss where that is missing) at the end of the run (when it timed out:
  the child's VmHWM read just before it was killed, a lower bound): includes
  Python, TensorFlow and the graph.

A child process that runs past `--timeout` seconds is killed; the figures it
had not reached are printed as "> T" with T the time the phase had run when it
was killed (a lower bound), or "timeout" when none can be given (ops out of a
rewrite that never finished). Once the EPL side of (L, M) times out, EPL at a
larger M for the same L is not run ("skipped"; `--run-all` runs it anyway),
nor are the later repeats of that configuration.

Ratio lines (a bound stays a bound, prefixed ">"):

    startup: rewrite(M=64)/rewrite(M=4) = X (L=12) Y (L=24); target <= 1.5
    startup: ops out/in = R (L=12 M=4) ... R (L=12 DP=4) ...; target <= 3
    startup: step ops EPL/plain = R (L=12 M=4) ...; target <= 3
    startup: (rewrite + first step)/plain first step = R (L=12 M=4) ...; target <= 2

the first with the largest and the smallest M of `--micro-batches`, the last
dividing EPL's rewrite plus first step by plain's first step (its session
creation, initialization and first step) at the same configuration.

    python bench/startup.py                         # L 12 24, M 4 16 64, DP 4, 3 repeats
    python bench/startup.py --layers 12 --micro-batches 4 16 --repeats 1 --timeout 400
    python bench/startup.py --quick                 # 2 layers, M 2 4, DP 2, 1 repeat (smoke test)
    python bench/startup.py --no-grappler ...       # the same with Grappler off on both sides
    python bench/startup.py --copies ...            # EPL with pipeline.unit_functions off
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STAGES = 2
TAG = "STARTUP "   # prefix of the child's result lines
TARGETS = {"rewrite": 1.5, "ops": 3, "first": 2}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--dp-replicas", type=int, default=4,
                        help="replicas of the data-parallel configuration (0: none)")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch (pipeline) or "
                        "per-replica batch (data parallelism), in rows")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="steady steps after the first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds per child process (one configuration, one side)")
    parser.add_argument("--run-all", action="store_true",
                        help="run EPL at larger M even after a smaller M timed out")
    parser.add_argument("--quick", action="store_true",
                        help="2 layers, M 2 4, DP 2 replicas, 1 repeat, 2 steps (smoke test)")
    parser.add_argument("--no-grappler", action="store_true",
                        help="both sides' sessions with Grappler off (rewrite_options."
                        "disable_meta_optimizer): how much of the first step is graph "
                        "optimization")
    parser.add_argument("--copies", action="store_true",
                        help="EPL side with pipeline.unit_functions off (a copy of each stage's "
                             "ops per unit instead of a call of a shared function, the default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)   # internal: one measurement
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.micro_batches, args.dp_replicas = [2], [2, 4], 2
        args.repeats, args.steps, args.timeout = 1, 2, min(args.timeout, 120.0)
    if any(n < 2 for n in args.layers):
        parser.error("--layers: at least 2 (one per stage)")
    args.micro_batches = sorted(set(args.micro_batches))
    return args


# -- the child: one configuration, one side ---------------------------------------------

def _peak_rss_mb(pid: str = "self") -> float | None:
    """VmHWM of process `pid` in MiB (this process: ru_maxrss where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    if pid != "self":
        return None
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # KiB on Linux


def _emit(**values) -> None:
    values["peak_rss_mb"] = _peak_rss_mb()
    print(TAG + json.dumps(values), flush=True)


def run_child(spec: dict) -> None:
    """Build, rewrite (epl), start and train one configuration; print STARTUP lines."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    sys.path.insert(0, ROOT)
    import contextlib
    import statistics

    import bert_pipeline as bert   # imports TensorFlow
    import tensorflow as tf

    use_epl, dp = spec["side"] == "epl", spec["kind"] == "dp"
    units = spec["replicas"] if dp else spec["micro"]
    rows = spec["batch"] if use_epl else units * spec["batch"]   # rows per get_next()
    if use_epl:
        import epl
        config = {"cluster.virtual_devices": spec["replicas"] if dp else STAGES}
        if not dp:
            config["pipeline.num_micro_batch"] = spec["micro"]
        if spec.get("copies"):
            config["pipeline.unit_functions"] = False
        epl.init(epl.Config(config))

    def scope(name):
        if not use_epl:
            return contextlib.nullcontext()
        return epl.replicate(device_count=1, name=name)

    layers, hidden, heads, vocab, seq, masked = spec["layers"], spec["hidden"], 4, 64, 16, 2
    graph = tf.Graph()
    _emit(phase="build", start=time.time())
    start = time.perf_counter()
    with graph.as_default():
        tokens, positions, targets = tf.compat.v1.data.make_one_shot_iterator(
            bert.synthetic_dataset(rows, seq, vocab, masked)).get_next()
        with scope("data_parallel") if dp else contextlib.nullcontext():
            with contextlib.nullcontext() if dp else scope("stage_0"):
                x = bert.embeddings(tokens, vocab, hidden)
                for i in range(layers // 2):
                    x = bert.transformer_layer(x, heads, 4 * hidden, f"layer_{i}")
            with contextlib.nullcontext() if dp else scope("stage_1"):
                for i in range(layers // 2, layers):
                    x = bert.transformer_layer(x, heads, 4 * hidden, f"layer_{i}")
                loss, _ = bert.masked_token_head(x, positions, targets, vocab)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train_op = tf.compat.v1.train.AdamOptimizer(3e-3).minimize(loss, global_step=global_step)
    ops_in = len(graph.get_operations())
    _emit(phase="build", build_s=time.perf_counter() - start, ops_in=ops_in)

    if use_epl:
        _emit(phase="rewrite", start=time.time())
        start = time.perf_counter()
        result = epl.parallelize(graph)
        rewrite_s = time.perf_counter() - start
        expected = spec["replicas"] if dp else 1
        if result.plan.num_replicas != expected:
            raise RuntimeError(f"expected {expected} replica(s), the plan has "
                               f"{result.plan.num_replicas}")
    else:
        rewrite_s = 0.0
    _emit(phase="rewrite", rewrite_s=rewrite_s, ops_out=len(graph.get_operations()),
          step_ops=_step_ops(graph, train_op))
    if use_epl:   # each pass's own time (PassContext.timings), for the per-pass table
        _emit(phase="rewrite", **{PASS_PREFIX + name: seconds
                                  for name, seconds in result.timings.items()})

    _emit(phase="first", start=time.time())
    start = time.perf_counter()
    with graph.as_default():
        init = tf.compat.v1.global_variables_initializer()
    session_config = tf.compat.v1.ConfigProto()
    if not spec.get("grappler", True):
        session_config.graph_options.rewrite_options.disable_meta_optimizer = True
    session = tf.compat.v1.Session(graph=graph, config=session_config)
    session.run(init)
    session.run(train_op)
    _emit(phase="first", first_s=time.perf_counter() - start)

    _emit(phase="steady", start=time.time())
    steps = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        session.run(train_op)
        steps.append(time.perf_counter() - start)
    session.close()
    _emit(phase="steady", steady_s=statistics.median(steps) if steps else 0.0, done=True)


def _step_ops(graph, train_op) -> int:
    """The ops a training step runs (what TensorFlow optimizes and places at the first
    step): the train op and everything it reads or waits for, plus the nodes of each
    library function those call, counted once per function."""
    seen, stack, called = set(), [train_op], set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            called.add(op.get_attr("f").name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    return len(seen) + sum(len(library[name].node_def) for name in called)


# -- the parent: run the children, collect, print -------------------------------------------

# a figure named PASS_PREFIX + pass name is that pass's seconds in EPL's rewrite
PASS_PREFIX = "pass:"

# measured figure -> the phase whose start bounds it when the child was killed
PHASE_OF = {"build_s": "build", "rewrite_s": "rewrite", "first_s": "first", "steady_s": "steady"}


def run_one(spec: dict, timeout: float) -> dict:
    """Run one child; return its figures: {name: (value, exact)}, plus status."""
    env = dict(os.environ)
    env.setdefault("TF_USE_LEGACY_KERAS", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    began = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    status = "ok"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        peak_at_kill = _peak_rss_mb(str(proc.pid))   # its peak so far, read before the kill
        os.killpg(proc.pid, signal.SIGKILL)   # the child's own process group
        killed_at = time.time()
        out, err = proc.communicate()
        status = "timeout"
    except BaseException:   # Ctrl-C: the child is in its own session, end it too
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    else:
        killed_at = time.time()
    lines = [json.loads(line[len(TAG):]) for line in out.splitlines() if line.startswith(TAG)]
    done = any(r.get("done") for r in lines)
    if status == "timeout" and done:   # every figure measured; killed while exiting
        status = "ok"
    elif status == "ok" and (proc.returncode != 0 or not done):
        status = "error"
        sys.stderr.write(f"startup: child {spec} failed (rc {proc.returncode}):\n{err[-4000:]}\n")
    figures, starts = {}, {}
    for record in lines:
        if "start" in record:
            starts[record["phase"]] = record["start"]
        for key, value in record.items():
            if key not in ("phase", "start", "done"):
                figures[key] = (value, True)
    if status == "timeout":
        for key, phase in PHASE_OF.items():
            if key not in figures and phase in starts:
                figures[key] = (killed_at - starts[phase], False)
        last_report = figures.get("peak_rss_mb", (None,))[0]
        peak = max((p for p in (peak_at_kill, last_report) if p is not None), default=None)
        if peak is not None:   # the peak it had reached when it was killed: a lower bound
            figures["peak_rss_mb"] = (peak, False)
    figures["wall_s"] = (killed_at - began, status == "ok")
    return {"status": status, "figures": figures}


def summarize(runs: list[dict]) -> dict:
    """Per figure: (median, exact) over the runs that have it; exact only if all were exact
    (a median of lower bounds is a lower bound of the median)."""
    from common import median
    names = {name for run in runs for name in run["figures"]}
    summary = {}
    for name in names:
        values = [run["figures"][name] for run in runs if name in run["figures"]]
        if len(values) == len(runs) or all(exact for _, exact in values):
            summary[name] = (median([v for v, _ in values]),
                             len(values) == len(runs) and all(e for _, e in values))
    summary["status"] = ("timeout" if any(r["status"] == "timeout" for r in runs) else
                         "error" if any(r["status"] == "error" for r in runs) else "ok")
    return summary


def fmt(figure, digits: int = 2, missing: str = "timeout") -> str:
    if figure is None:
        return missing
    value, exact = figure
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return text if exact else ">" + text


def ratio(num, den, digits: int = 2) -> str:
    """num / den of two (value, exact) figures: a lower bound when num is one; "timeout"
    when either is missing, "n/a" when den is itself a bound or zero."""
    if num is None or den is None:
        return "timeout"
    if not den[1] or den[0] <= 0:
        return "n/a"
    return fmt((num[0] / den[0], num[1]), digits)


def print_pass_table(configs, runs, summary, format_table) -> None:
    """Per-pass time per output op (microseconds per op of the rewritten graph) of each EPL
    configuration that finished its rewrite: a pass whose figure grows with M grows faster
    than the graph it writes (issue 29, item 1). Passes that took under 1 ms everywhere
    are left out. The last column divides the whole rewrite by the ops it added (ops out
    - ops in): the ops in (the user's model, which the rewrite keeps as the template) are
    in every configuration's "ops out" and cost the rewrite little, so per output op a
    rewrite linear in what it adds looks cheaper at small M; per added op it is flat
    in M where the rewrite is linear."""
    done = [(label, summary[(label, "epl")]) for label, _ in configs
            if summary[(label, "epl")] is not None
            and (summary[(label, "epl")].get("ops_out") or (0, False))[1]]
    names = []   # in the order the passes ran (the order the child emitted them)
    for run in (run for label, _ in done for run in runs[(label, "epl")]):
        names += [key[len(PASS_PREFIX):] for key in run["figures"]
                  if key.startswith(PASS_PREFIX) and key[len(PASS_PREFIX):] not in names]
    names = [name for name in names
             if any(s.get(PASS_PREFIX + name, (0.0,))[0] >= 1e-3 for _, s in done)]
    if not names:
        return
    rows = []
    for label, s in done:
        ops_out = s["ops_out"][0]
        added = ops_out - s["ops_in"][0]
        rows.append([label, fmt((ops_out, True), 0)] + [
            fmt((1e6 * s[PASS_PREFIX + name][0] / ops_out, True), 1)
            if PASS_PREFIX + name in s else "-" for name in names]
            + [fmt((1e6 * s["rewrite_s"][0] / ops_out, True), 1),
               fmt((1e6 * s["rewrite_s"][0] / added, True), 1) if added > 0 else "n/a"])
    print("startup: per-pass time per output op, microseconds (a column that grows with M "
          "grows faster than the graph the rewrite writes); last column: the rewrite per op "
          "it added (ops out - ops in)")
    print(format_table(["config", "ops out"] + names + ["rewrite", "per added op"], rows))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        run_child(json.loads(args.child))
        return {}
    sys.path[:0] = [HERE, ROOT]
    from epl.observability.logs import quiet_tensorflow_startup
    with quiet_tensorflow_startup():   # common imports TensorFlow
        from common import format_table

    base = {"batch": args.batch, "hidden": args.hidden, "steps": args.steps,
            "grappler": not args.no_grappler, "copies": args.copies}
    configs = []   # (label, spec)
    for layers in args.layers:
        for micro in args.micro_batches:
            configs.append((f"L={layers} M={micro}",
                            dict(base, kind="pipeline", layers=layers, micro=micro, replicas=1)))
        if args.dp_replicas:
            configs.append((f"L={layers} DP={args.dp_replicas}",
                            dict(base, kind="dp", layers=layers, micro=1,
                                 replicas=args.dp_replicas)))
    dp = (f"{args.dp_replicas} replicas x {args.batch} rows" if args.dp_replicas
          else "not run")
    print(f"startup: BERT-style encoder (examples/bert_pipeline.py), hidden {args.hidden}, "
          f"heads 4, vocab 64, seq 16, Adam; pipeline: {STAGES} stages on {STAGES} virtual CPU "
          f"devices, micro-batch {args.batch}; data parallelism: {dp}; plain TensorFlow: one "
          f"device, the same global batch; medians of "
          f"{args.repeats} run(s), each (configuration, side) in a fresh process, timeout "
          f"{args.timeout:.0f} s per process"
          + ("; Grappler off in both sides' sessions" if args.no_grappler else "")
          + ("; EPL with pipeline.unit_functions off (copies)" if args.copies else ""), flush=True)

    runs = {(label, side): [] for label, _ in configs for side in ("epl", "plain")}
    skipped = {}   # label -> why EPL was not run
    timed_out_layers = {}   # layers -> smallest M whose EPL side timed out (in any repeat)
    total, count = len(configs) * 2 * args.repeats, 0
    for repeat in range(args.repeats):
        for label, spec in configs:
            sides = ("epl", "plain") if repeat % 2 == 0 else ("plain", "epl")
            for side in sides:
                count += 1
                key = (label, side)
                if side == "epl":
                    earlier = [r for r in runs[key] if r["status"] == "timeout"]
                    smaller = timed_out_layers.get(spec["layers"])
                    if earlier:
                        continue   # one timed-out run stands for the later repeats
                    if (not args.run_all and spec["kind"] == "pipeline" and smaller is not None
                            and spec["micro"] > smaller):
                        skipped.setdefault(label, f"M={smaller} at L={spec['layers']} timed out")
                        continue
                result = run_one(dict(spec, side=side), args.timeout)
                runs[key].append(result)
                if side == "epl" and result["status"] == "timeout" and spec["kind"] == "pipeline":
                    previous = timed_out_layers.get(spec["layers"], spec["micro"])
                    timed_out_layers[spec["layers"]] = min(previous, spec["micro"])
                print(f"startup: [{count}/{total}] {label} {side}: {result['status']}, "
                      f"{result['figures']['wall_s'][0]:.1f} s", file=sys.stderr, flush=True)

    summary = {key: summarize(value) if value else None for key, value in runs.items()}
    if any(s and s["status"] == "error" for s in summary.values()):
        print("startup: some runs failed (their stderr is above); their missing figures read "
              "'timeout' below, and the exit status is 1")

    rows = []
    for label, _ in configs:
        for side in ("epl", "plain"):
            s = summary[(label, side)]
            if s is None:
                rows.append([label, side] + ["skipped"] * 10)
                continue
            get = s.get
            out_in = ratio(get("ops_out"), get("ops_in"))
            total_first = None
            if get("first_s") is not None and get("rewrite_s") is not None:
                total_first = (get("rewrite_s")[0] + get("first_s")[0],
                               get("rewrite_s")[1] and get("first_s")[1])
            elif get("rewrite_s") is not None and not get("rewrite_s")[1]:
                total_first = get("rewrite_s")
            rows.append([label, side, fmt(get("ops_in"), 0), fmt(get("ops_out"), 0), out_in,
                         fmt(get("step_ops"), 0), fmt(get("build_s")), fmt(get("rewrite_s")), fmt(get("first_s")),
                         fmt(total_first), fmt(get("steady_s"), 3), fmt(get("peak_rss_mb"), 0)])
    print(format_table(["config", "side", "ops in", "ops out", "out/in", "step ops", "build s", "rewrite s",
                        "first step s", "rewrite+first s", "steady s", "peak RSS MB"], rows))
    print_pass_table(configs, runs, summary, format_table)
    for label, why in skipped.items():
        if not runs[(label, "epl")]:
            print(f"startup: {label} epl skipped: {why} (--run-all runs it)")

    def epl_figure(label, name):
        s = summary[(label, "epl")]
        return None if s is None else s.get(name)

    def label_skipped(label):
        return summary[(label, "epl")] is None

    # rewrite(M=max)/rewrite(M=min) per L
    lo, hi = args.micro_batches[0], args.micro_batches[-1]
    parts = []
    for layers in args.layers:
        low, high = f"L={layers} M={lo}", f"L={layers} M={hi}"
        if label_skipped(high) or label_skipped(low):
            value = "skipped"
        elif lo == hi:
            value = "n/a"
        else:
            value = ratio(epl_figure(high, "rewrite_s"), epl_figure(low, "rewrite_s"))
        parts.append(f"{value} (L={layers})")
    print(f"startup: rewrite(M={hi})/rewrite(M={lo}) = {' '.join(parts)}; "
          f"target <= {TARGETS['rewrite']}")
    ops, first, step_ops = [], [], []
    for label, _ in configs:
        if label_skipped(label):
            ops.append(f"skipped ({label})")
            first.append(f"skipped ({label})")
            continue
        ops.append(f"{ratio(epl_figure(label, 'ops_out'), epl_figure(label, 'ops_in'))} ({label})")
        plain_step = (summary[(label, "plain")] or {}).get("step_ops")
        step_ops.append(f"{ratio(epl_figure(label, 'step_ops'), plain_step)} ({label})")
        plain = summary[(label, "plain")]
        rewrite, first_s = epl_figure(label, "rewrite_s"), epl_figure(label, "first_s")
        if rewrite is not None and first_s is not None:
            num = (rewrite[0] + first_s[0], rewrite[1] and first_s[1])
        else:
            num = rewrite if rewrite is not None and not rewrite[1] else None
        first.append(f"{ratio(num, plain and plain.get('first_s'))} ({label})")
    print(f"startup: ops out/in = {' '.join(ops)}; target <= {TARGETS['ops']}")
    print(f"startup: step ops EPL/plain = {' '.join(step_ops)}; target <= {TARGETS['ops']}")
    print(f"startup: (rewrite + first step)/plain first step = {' '.join(first)}; "
          f"target <= {TARGETS['first']}")
    steady, rss = [], []
    for label, _ in configs:
        if label_skipped(label):
            continue
        plain = summary[(label, "plain")] or {}
        steady.append(f"{ratio(epl_figure(label, 'steady_s'), plain.get('steady_s'))} ({label})")
        rss.append(f"{ratio(epl_figure(label, 'peak_rss_mb'), plain.get('peak_rss_mb'))} ({label})")
    print(f"startup: steady step EPL/plain = {' '.join(steady)} (no target)")
    print(f"startup: peak RSS EPL/plain = {' '.join(rss)} (no target)", flush=True)
    errors = sorted({label for (label, _), s in summary.items() if s and s["status"] == "error"})
    return {"summary": summary, "skipped": skipped, "errors": errors}


if __name__ == "__main__":
    sys.exit(1 if main().get("errors") else 0)

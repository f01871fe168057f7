"""`epl-plan`: the dry-run planner, with no accelerator.

    epl-plan --cluster SPEC (--model NAME | --graph FILE | --script FILE
             [-- SCRIPT_ARGS...]) [--optimizer adam] [--global-batch N]
             [--dtype float32|float16] [--offload] [--pipeline-stages S]
             [--micro-batches M] [--efficiency E] [--profiles JSON]
             [--json]
    epl-plan --calibrate [--output FILE]

SPEC is a cluster string such as "2x8xV100-32GB,2x8xT4" (HOSTS x DEVICES x
PROFILE tokens; see epl.planner.profiles.parse_cluster).  A token may end with its
hosts' network, "@NICSxRATE" or "@RATE" with RATE in Gbps, Gb/s, GBps or
GB/s, e.g. "2x8xA100-80GB@8x200Gbps,2x8xT4@1x100Gbps" (DGX A100-like hosts
with eight 200 Gb/s NICs each, T4 hosts with one 100 Gb/s NIC); without
one, a host has one NIC at its profile's inter-node bandwidth (100 Gb/s).
The model comes from

- ``--model NAME``: a built-in synthetic description, so that the tool runs
  with nothing else: "bert-base" (12-layer BERT, sequence 128),
  "resnet50" (ResNet-50 v1.5 on 224x224 images), "m6-mini" (a 12-layer
  mixture-of-experts transformer with 32 experts per layer, ~1.9 B
  parameters) and "m6-10t" (a 24-layer mixture-of-experts transformer with
  3072 experts per layer, ~9.9 T parameters in 16-bit, M6-10T's scale).
  They are described analytically, layer by layer (FLOPs, activation and
  parameter bytes), not built as TensorFlow graphs.
- ``--graph FILE``: a saved GraphDef (.pbtxt or .pb), e.g. a pass dump of
  ``debug.dump_dir``; one layer per TaskGraph (``_epl_taskgraph``).
- ``--script FILE``: a training script, run in this process until EPL
  would parallelize its graph (`epl.capture`: its first session,
  MonitoredTrainingSession or epl.parallelize()); EPL's rewrite never runs,
  and the script's own output goes to stderr.  The graph it built is
  planned, with its epl.init config's ``cluster.device_profiles`` as profile
  overrides, at the global batch of the run it predicts: the script on the
  cluster, one worker per host, by EPL's batch contract (the script's batch
  is one replica's micro-batch: workers x replicas x micro-batches x batch;
  with ``io.batch_mode: "global"`` it is each worker's); a "Batch:" line
  says how it is made up (``--global-batch`` overrides it).  The model line
  names the model's layers (its variables' scopes) and the TaskGraphs the
  planner places.  Arguments after ``--`` go to the script.

It prints the model, the cluster and each host group's network, the chosen
plan with a table of one row per group of identical devices doing the same
(device and host ranges, count, batch share, shards, stage, parameter,
gradient, optimizer-state and activation memory against the usable memory,
in B/KiB/MiB/GiB chosen per value, predicted compute and communication time
per step), and every alternative it considered with its predicted step time
or the constraint that ruled it out.  The chosen plan is the earliest
listed alternative that fits and is within 3% of the fastest one's step
time (a simplicity margin: ZeRO or checkpointing must be more than 3%
faster to be chosen, the cost model is not more precise than that); a
faster alternative inside the margin says so.  Op types the cost model does
not know (a graph's training step's; tf.data's input ops are known) are
named with their counts.  ``--json`` prints the
same as JSON (`ClusterPlan.as_dict`).

Identical hosts (same profile, device count and network) are planned as
one group, so a cluster of 100,000 hosts plans in seconds.  ``--model``
never imports TensorFlow; ``--graph`` and ``--script`` do.

``--calibrate`` (its progress on stderr, a line per round; a warning when
the host is loaded, its load average above half its cores, and for each
fitted value far outside the range an idle 2-core host fits,
`EXPECTED_RANGES`) measures this machine's "CPU" profile with TensorFlow's
micro-benchmark (`epl.planner.calibration.calibrate_cpu_profile`: a training step's
fixed, per-op, costly-kernel, FLOP and optimizer costs fitted on reference
training steps, memory bandwidth, the local collectives' latency and
bandwidth, the input reads and the replicas' sync) and prints it, or
writes it to ``--output FILE``, as the JSON object that ``--profiles
FILE`` and ``cluster.device_profiles`` accept (``{"CPU": {...}}``; virtual
CPU devices share it).  Giving that file skips
the measurement every process would otherwise make, and lets every worker
plan with the same figures.  GPU profiles keep their published figures.

Errors (a cluster string that does not parse, an unknown device profile, a
model that fits nowhere, a missing or unreadable file, a script that builds
no graph) print "epl-plan: error: ..." and exit with code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from epl.errors import EPLError
from epl.observability.logs import quiet_tensorflow_startup
from epl.planner.planner import LayerSpec, ModelSpec

GiB = float(1 << 30)
#: Sub-word vocabularies of the built-ins: BERT's English WordPiece and the
#: Chinese BERT vocabulary M6 uses.
BERT_VOCAB, M6_VOCAB = 30522, 21128


# --------------------------------------------------------------------------
# Built-in model descriptions.
# --------------------------------------------------------------------------

def _dtype_bytes(dtype: str) -> int:
    """Bytes of an activation element under `dtype`."""
    return 2 if dtype in ("float16", "bfloat16") else 4


def transformer_layer(name: str, seq: int, hidden: int, heads: int,
                      ffn: int, dtype: str = "float32", experts: int = 0,
                      param_bytes: int = 4) -> LayerSpec:
    """One transformer encoder layer (post-LN BERT layout) as a LayerSpec.

    FLOPs per example (a sequence of `seq` tokens), multiply-add = 2:
    QKV and output projections 8*s*h^2, attention scores and context
    4*s^2*h, the FFN 4*s*h*f, softmax 5*a*s^2, layer norms, GELU and
    residuals about 20*s*h + 8*s*f; backward twice the forward.
    Activations kept for backward (Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", in 16-bit with
    1-byte dropout masks): s*h*(18 + 4*f/h) + 5*a*s^2 bytes, scaled by the
    element size / 2.  With `experts` > 0 the FFN is a mixture of experts
    with top-1 routing: its parameters (times `experts`), FLOPs and
    activations are the layer's split part, plus a router (h x experts) and
    an all-to-all of each token's hidden vector (dispatch and combine,
    forward and backward).
    """
    s, h, a, f = seq, hidden, heads, ffn
    scale = _dtype_bytes(dtype) / 2
    attn_flops = 8 * s * h * h + 4 * s * s * h + 5 * a * s * s + 20 * s * h
    ffn_flops = 4 * s * h * f + 8 * s * f
    attn_act = (15 * s * h + 5 * a * s * s) * scale
    ffn_act = (3 * s * h + 4 * s * f) * scale
    attn_params = (4 * h * h + 4 * h + 4 * h) * param_bytes
    ffn_params = (2 * h * f + f + h) * param_bytes
    if not experts:
        return LayerSpec(
            name, flops_per_example=3 * (attn_flops + ffn_flops),
            bytes_per_example=4 * (attn_act + ffn_act),
            activation_bytes_per_example=attn_act + ffn_act,
            parameter_bytes=attn_params + ffn_params)
    router_flops = 2 * s * h * experts
    return LayerSpec(
        name, flops_per_example=3 * (attn_flops + router_flops),
        bytes_per_example=4 * attn_act,
        activation_bytes_per_example=attn_act,
        parameter_bytes=attn_params + h * experts * param_bytes,
        split_parameter_bytes=experts * ffn_params,
        split_flops_per_example=3 * ffn_flops,
        split_bytes_per_example=4 * ffn_act,
        split_activation_bytes_per_example=ffn_act,
        alltoall_bytes_per_example=4 * s * h * _dtype_bytes(dtype))


def _embedding(name: str, vocab: int, seq: int, hidden: int, dtype: str,
               param_bytes: int = 4) -> LayerSpec:
    """Token + position embeddings with a layer norm."""
    act = 2 * seq * hidden * _dtype_bytes(dtype)
    return LayerSpec(name, flops_per_example=3 * 10 * seq * hidden,
                     bytes_per_example=4 * act,
                     activation_bytes_per_example=act,
                     parameter_bytes=(vocab + seq + 4) * hidden * param_bytes)


def _lm_head(name: str, vocab: int, predictions: int, hidden: int,
             dtype: str, param_bytes: int = 4) -> LayerSpec:
    """Masked-LM head on `predictions` positions (decoder tied to the
    embedding: only its bias and the transform are parameters here)."""
    flops = 2 * predictions * hidden * (hidden + vocab) + \
        8 * predictions * vocab
    act = predictions * (2 * hidden + 2 * vocab) * _dtype_bytes(dtype)
    return LayerSpec(name, flops_per_example=3 * flops,
                     bytes_per_example=4 * act,
                     activation_bytes_per_example=act,
                     parameter_bytes=(hidden * hidden + 3 * hidden + vocab
                                      + hidden * hidden + 2 * hidden)
                     * param_bytes)


def bert_base(dtype: str = "float32", seq: int = 128) -> ModelSpec:
    """BERT-base pre-training (~110 M parameters), sequences of `seq`."""
    h = 768
    layers = [_embedding("embeddings", BERT_VOCAB, seq, h, dtype)]
    layers += [transformer_layer(f"layer_{i}", seq, h, 12, 4 * h, dtype)
               for i in range(12)]
    layers.append(_lm_head("mlm_head", BERT_VOCAB, 20, h, dtype))
    return ModelSpec("bert-base", tuple(layers), compute_dtype=dtype)


def _conv(h_out: int, c_in: int, c_out: int, k: int, dsize: int
          ) -> tuple[float, float, float, float]:
    """(forward FLOPs, activation bytes, traffic bytes, params) of a conv
    with batch norm and ReLU, per image."""
    out = h_out * h_out * c_out
    flops = 2 * out * k * k * c_in + 8 * out  # conv + BN (7) + ReLU (1)
    act = 2 * out * dsize  # BN input and ReLU output
    return flops, act, 6 * out * dsize, (k * k * c_in + 2) * c_out * 4


def _block(name: str, size: int, c_in: int, mid: int, stride: int,
           project: bool, dsize: int) -> LayerSpec:
    """One ResNet v1.5 bottleneck block (stride on the 3x3 conv)."""
    out = size // stride
    parts = [_conv(size, c_in, mid, 1, dsize), _conv(out, mid, mid, 3, dsize),
             _conv(out, mid, 4 * mid, 1, dsize)]
    if project:
        parts.append(_conv(out, c_in, 4 * mid, 1, dsize))
    flops = sum(p[0] for p in parts) + out * out * 4 * mid  # residual add
    act = sum(p[1] for p in parts)
    return LayerSpec(name, flops_per_example=3 * flops,
                     bytes_per_example=3 * sum(p[2] for p in parts),
                     activation_bytes_per_example=act,
                     parameter_bytes=sum(p[3] for p in parts))


def resnet50(dtype: str = "float32") -> ModelSpec:
    """ResNet-50 v1.5 on 224x224x3 images (~25.6 M parameters)."""
    dsize = _dtype_bytes(dtype)
    stem = _conv(112, 3, 64, 7, dsize)
    layers = [LayerSpec("stem", flops_per_example=3 * stem[0],
                        bytes_per_example=3 * stem[2],
                        activation_bytes_per_example=stem[1]
                        + 112 * 112 * 64 * dsize,  # max-pool input
                        parameter_bytes=stem[3])]
    size, c_in = 56, 64
    for stage, (blocks, mid) in enumerate([(3, 64), (4, 128), (6, 256),
                                           (3, 512)]):
        for b in range(blocks):
            stride = 2 if b == 0 and stage > 0 else 1
            layers.append(_block(f"stage{stage + 1}_block{b + 1}", size, c_in,
                                 mid, stride, b == 0, dsize))
            size, c_in = size // stride, 4 * mid
    layers.append(LayerSpec("head", flops_per_example=3 * 2 * 2048 * 1000,
                            bytes_per_example=3 * 7 * 7 * 2048 * dsize,
                            activation_bytes_per_example=(2048 + 1000) * 4,
                            parameter_bytes=(2048 * 1000 + 1000) * 4))
    return ModelSpec("resnet50", tuple(layers), compute_dtype=dtype)


def m6_mini(dtype: str = "float32") -> ModelSpec:
    """A small M6-style mixture-of-experts transformer: 12 layers, hidden
    768, 32 experts of FFN 3072 per layer, sequences of 256 (~1.9 B
    parameters)."""
    seq, h, experts = 256, 768, 32
    layers = [_embedding("embeddings", M6_VOCAB, seq, h, dtype)]
    layers += [transformer_layer(f"moe_layer_{i}", seq, h, 12, 4 * h, dtype,
                                 experts) for i in range(12)]
    layers.append(_lm_head("lm_head", M6_VOCAB, seq, h, dtype))
    return ModelSpec("m6-mini", tuple(layers), compute_dtype=dtype,
                     split_units=experts)


def m6_10t(dtype: str = "float16") -> ModelSpec:
    """M6-10T's scale: 24 mixture-of-experts layers, hidden 4096, 32 heads,
    3072 experts of FFN 16384 per layer (top-1), sequences of 512: about
    9.9 trillion parameters.  Parameters, gradients and optimizer state are
    held in 16-bit (2 bytes each), as multi-trillion-parameter training
    with offload does; activations in `dtype`."""
    seq, h, experts = 512, 4096, 3072
    layers = [_embedding("embeddings", M6_VOCAB, seq, h, dtype, 2)]
    layers += [transformer_layer(f"moe_layer_{i}", seq, h, 32, 4 * h, dtype,
                                 experts, param_bytes=2) for i in range(24)]
    layers.append(_lm_head("lm_head", M6_VOCAB, seq, h, dtype, 2))
    return ModelSpec("m6-10t", tuple(layers), compute_dtype=dtype,
                     parameter_dtype_bytes=2, split_units=experts,
                     notes=("m6-10t: parameters, gradients and optimizer "
                            "state in 16-bit",))


#: name -> (builder(dtype), default dtype, default examples per device).
BUILTIN_MODELS = {
    "bert-base": (bert_base, "float32", 32),
    "resnet50": (resnet50, "float32", 64),
    "m6-mini": (m6_mini, "float32", 16),
    "m6-10t": (m6_10t, "float16", 2),
}


def builtin_model(name: str, dtype: str | None = None) -> ModelSpec:
    """The built-in model `name` ("bert-base", "resnet50", "m6-mini",
    "m6-10t") in `dtype` (default: the model's own)."""
    key = name.strip().lower().replace("_", "-")
    key = {"bert": "bert-base", "resnet-50": "resnet50",
           "m610t": "m6-10t"}.get(key, key)
    if key not in BUILTIN_MODELS:
        raise PlanInputError(f"unknown built-in model {name!r}; choose one "
                             f"of {sorted(BUILTIN_MODELS)}")
    builder, default_dtype, _ = BUILTIN_MODELS[key]
    return builder(dtype or default_dtype)


def default_batch_per_device(name: str) -> int:
    """Examples per device the built-in `name` defaults to."""
    return BUILTIN_MODELS[name][2]


# --------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------

class PlanInputError(EPLError):
    """A problem with epl-plan's inputs (file, script, model name)."""


# --------------------------------------------------------------------------
# The command line.
# --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `epl-plan`."""
    parser = argparse.ArgumentParser(
        prog="epl-plan",
        description="Dry-run planner: per-device work, memory and predicted "
                    "time of a model on a cluster, with no accelerator.")
    parser.add_argument("--cluster",
                        help='cluster string, e.g. "2x8xV100-32GB,2x8xT4"; '
                             'a token may end with its hosts\' network, '
                             '"@NICSxRATE": "2x8xA100-80GB@8x200Gbps,'
                             '2x8xT4@1x100Gbps" (default: one 100 Gb/s NIC '
                             'per host)')
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--calibrate", action="store_true",
                        help='measure this machine\'s "CPU" profile and '
                             'print it (or write it to --output) as a '
                             '--profiles file')
    source.add_argument("--model", help="built-in model: "
                        + ", ".join(sorted(BUILTIN_MODELS)))
    source.add_argument("--graph", help="saved GraphDef (.pbtxt or .pb)")
    source.add_argument("--script", help="training script to capture")
    parser.add_argument("--optimizer", default=None,
                        help="adam, sgd, momentum, ... (default: from the "
                             "graph, else adam)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="examples per step (default: the graph's batch, "
                             "else a per-model default per device)")
    parser.add_argument("--dtype", default=None,
                        choices=["float32", "float16", "bfloat16"],
                        help="compute dtype (float16/bfloat16: mixed "
                             "precision)")
    parser.add_argument("--offload", action="store_true",
                        help="keep parameters and optimizer state in host "
                             "memory")
    parser.add_argument("--host-memory", type=float, default=None,
                        help="host memory per device in GB (offload; "
                             "default 192)")
    parser.add_argument("--pipeline-stages", type=int, default=None,
                        help="also consider a pipeline of this many stages")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="micro-batches per pipeline step (default 4)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="fraction of peak FLOP/s reached (default 0.5)")
    parser.add_argument("--profiles", default=None,
                        help="cluster.device_profiles overrides as JSON, or "
                             "a JSON file")
    parser.add_argument("--json", action="store_true",
                        help="print the plan as JSON (chosen plan, rows per "
                             "group of identical devices, alternatives with "
                             "their step time or the constraint that ruled "
                             "them out, unknown op types)")
    parser.add_argument("--output", default=None,
                        help="--calibrate: the profile file to write")
    parser.add_argument("script_args", nargs="*",
                        help="arguments for --script (after --)")
    return parser


def _overrides(text: str | None) -> dict:
    """--profiles: inline JSON or a JSON file."""
    if not text:
        return {}
    try:
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as handle:
                value = json.load(handle)
        else:
            value = json.loads(text)
    except (OSError, ValueError) as err:
        raise PlanInputError(f"--profiles: cannot read {text!r} as JSON or "
                             f"a JSON file: {err}") from None
    if not isinstance(value, dict):
        raise PlanInputError(f"--profiles must be a JSON object of profile "
                             f"overrides, got {type(value).__name__}")
    return value


def _options(args: argparse.Namespace, config: Any):
    """PlanOptions from the flags (and a script's EPL config)."""
    from epl.planner.planner import PlanOptions
    fields: dict[str, Any] = {"offload": args.offload}
    if args.host_memory is not None:
        fields["host_memory_per_device"] = args.host_memory * GiB
    if args.pipeline_stages is not None:
        fields["pipeline_stages"] = args.pipeline_stages
    micro = args.micro_batches
    if micro is None and config is not None and \
            config.get("pipeline.num_micro_batch") > 1:
        micro = config.get("pipeline.num_micro_batch")
    if micro is not None:
        fields["num_micro_batch"] = micro
    if args.efficiency is not None:
        fields["efficiency"] = args.efficiency
    if args.dtype:
        fields["compute_dtype"] = args.dtype
    return PlanOptions(**fields)


def _model(args: argparse.Namespace) -> tuple[Any, Any, int | None]:
    """(model, the script's `epl.Capture` or None, default examples per device)."""
    if args.model:
        spec = builtin_model(args.model, args.dtype)
        return spec, None, default_batch_per_device(spec.name)
    with quiet_tensorflow_startup():
        import tensorflow  # noqa: F401  (--graph and --script need it)
    from epl.planner.planner import model_from_graph
    if args.graph:
        from epl.observability.dump_format import DumpError, load_graph_def
        try:
            graph_def = load_graph_def(args.graph)
        except DumpError as err:
            raise PlanInputError(str(err)) from None
        name = os.path.splitext(os.path.basename(args.graph))[0]
        return model_from_graph(graph_def, name=name), None, None
    import epl
    with contextlib.redirect_stdout(sys.stderr):   # the script's own lines: not the plan's
        captured = epl.capture(args.script, args.script_args)
    name = os.path.splitext(os.path.basename(args.script))[0]
    return (model_from_graph(captured.graph, name=name, record=captured.record),
            captured, None)


def script_batch(captured: Any, hosts: Sequence[Any], batch: int | None) -> Any:
    """The JobBatch of the run `epl-plan --script` predicts: the script (its
    TaskGraphs, `io.batch_mode`, `pipeline.num_micro_batch`) on `hosts`, one worker
    per host driving its devices, as `epl-launch` runs it; `batch` is the script's
    (its batch inputs' static first dimension). Each host holds as many replicas as
    its devices give (epl.planner.plan.split_layout: split TaskGraphs take their
    devices first unless colocated); with hosts of different sizes the replicas are
    counted over the whole cluster."""
    from epl.observability.summary import JobBatch
    from epl.planner.plan import split_layout
    from epl.runtime.cluster import Cluster
    config, taskgraphs = captured.config, list(captured.record.taskgraphs)
    colocate = bool(config.get("cluster.colocate_split_and_replicate"))
    per_replica = sum(tg.spec.device_count for tg in taskgraphs
                      if tg.spec.kind.value != "split") or 1
    replicas_on: dict[int, int] = {}
    for devices in {host.devices for host in hosts}:
        usable, _ = split_layout(taskgraphs, Cluster("CPU", devices, 0, len(hosts)),
                                 colocate)
        replicas_on[devices] = max(1, usable // per_replica)
    counts = [replicas_on[host.devices] for host in hosts]
    workers, replicas = (len(hosts), counts[0]) if len(set(counts)) == 1 else (1, sum(counts))
    return JobBatch(workers, replicas, int(config.get("pipeline.num_micro_batch")),
                    str(config.get("io.batch_mode")), batch)


def batch_line(job: Any) -> str:
    """The line epl-plan --script prints about the batch of the run it predicts."""
    if job.batch_mode == "replica":
        contract = (f"the script's batch {job.batch} is one replica's micro-batch "
                    "(io.batch_mode 'replica', EPL's contract)")
        unit = job.batch
    else:
        contract = (f"the script's batch {job.batch} is each worker's, cut among its "
                    "replicas and micro-batches (io.batch_mode 'global')")
        unit = job.batch / job.units_per_worker if job.batch is not None else None
    per_unit = f"{unit:g}" if unit is not None else "?"
    return (f"Batch: global batch {job.describe()} per step of this script on this cluster; "
            f"{contract}; {per_unit} per (replica, micro-batch)")


def calibrate(output: str | None, progress=None) -> str:
    """--calibrate: measure the CPU profile; write it to `output` when given.

    progress(line) gets a line as each round starts, and the warnings
    (`calibration_warnings`: a loaded host, fitted values far outside their
    expected ranges). Returns the profile file's JSON text, or a line naming the
    file written. Raises PlanInputError when `output` cannot be written.
    """
    from epl.planner.calibration import calibrate_cpu_profile, profile_file
    say = progress or (lambda line: None)
    for warning in host_load_warnings():
        say(warning)
    with quiet_tensorflow_startup():
        import tensorflow  # noqa: F401
    profile = calibrate_cpu_profile(progress=say)
    for warning in calibration_warnings(profile):
        say(warning)
    text = json.dumps(profile_file(profile), indent=1)
    if output is None:
        return text
    try:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    except OSError as err:
        raise PlanInputError(f"--output: cannot write {output!r}: "
                             f"{err.strerror}") from None
    return f"wrote the CPU profile to {output} (use it with --profiles " \
           f"{output} or as cluster.device_profiles)"


#: What `calibrate_cpu_profile` fits on an idle 2-core x86-64 host with AVX-512
#: (docs/planner.md, "Planner calibration"): field -> (low, high, unit scale, unit), FLOP/s
#: per core. A value more than `FAR` times outside its range gets a warning.
EXPECTED_RANGES = {
    "step_overhead_s": (0.3e-3, 0.45e-3, 1e3, "ms"),
    "op_overhead_s": (0.1e-6, 0.2e-6, 1e6, "us"),
    "flop_rate_per_core": (60e9, 78e9, 1e-9, "GFLOP/s per core"),
    "replica_concurrency": (0.7, 1.0, 1.0, ""),
    "replica_sync_s": (0.15e-3, 0.4e-3, 1e3, "ms"),
}
FAR = 3.0
#: A 1-minute load average above this fraction of the cores counts as a loaded host.
LOADED = 0.5


def host_load_warnings(load: float | None = None, cores: int | None = None) -> list[str]:
    """A warning when the host's 1-minute load average is above LOADED x its cores
    (os.getloadavg, os.sched_getaffinity): the calibration then measures the load."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # pragma: no cover - no load average on this platform
            return []
    cores = cores or len(os.sched_getaffinity(0))
    if load <= LOADED * cores:
        return []
    return [f"epl-plan: warning: the host is loaded (load average {load:.1f} over the last "
            f"minute on {cores} core{'' if cores == 1 else 's'}): the figures will measure "
            "that load, not the machine; calibrate on an idle host for figures that hold"]


def calibration_warnings(profile: Any) -> list[str]:
    """A warning for each fitted value of `profile` more than FAR times outside its
    EXPECTED_RANGES range."""
    from epl.planner.roofline import DEFAULT_EFFICIENCY
    cores = max(1, int(profile.host_cores or 1))
    values = {name: getattr(profile, name, None) for name in EXPECTED_RANGES}
    values["flop_rate_per_core"] = profile.peak_flops["float32"] * DEFAULT_EFFICIENCY / cores
    warnings = []
    for name, (low, high, scale, unit) in EXPECTED_RANGES.items():
        value = values[name]
        if value is None or low / FAR <= value <= high * FAR:
            continue
        suffix = f" {unit}" if unit else ""
        warnings.append(
            f"epl-plan: warning: {name} = {value * scale:.3g}{suffix} is far outside the "
            f"{low * scale:g}-{high * scale:g}{suffix} an idle 2-core host fits "
            "(docs/planner.md, \"Planner calibration\"): the host was busy, or its CPU "
            "differs; check the figures before planning with them")
    return warnings


def run(args: argparse.Namespace) -> str:
    """Plan as the flags say; returns explain()'s text, or with --json the
    plan's `ClusterPlan.as_dict()` as JSON; with --calibrate, `calibrate`'s
    answer (its progress and warnings on stderr)."""
    if args.calibrate:
        return calibrate(args.output, lambda line: print(line, file=sys.stderr, flush=True))
    if args.output:
        raise PlanInputError("--output is for --calibrate")
    if args.cluster is None:  # an empty one is parse_cluster's to explain
        raise PlanInputError("--cluster is required (or use --calibrate)")
    from epl.planner.planner import plan_cluster
    from epl.planner.profiles import parse_cluster
    overrides = _overrides(args.profiles)
    if not args.script:  # a script's epl.init may define more profiles
        parse_cluster(args.cluster, overrides or None)
    model, captured, per_device = _model(args)
    config = captured.config if captured is not None else None
    if config is not None:
        overrides = {**(config.get("cluster.device_profiles") or {}),
                     **overrides}
    hosts = parse_cluster(args.cluster, overrides or None)
    batch, job = args.global_batch, None
    if captured is not None:
        job = script_batch(captured, hosts, model.batch_size)
        batch = batch if batch is not None else job.global_batch
    if batch is None and per_device and not model.batch_size:
        batch = per_device * sum(h.devices for h in hosts)
    plan = plan_cluster(model, hosts, args.optimizer, batch,
                        _options(args, config))
    if args.json:
        answer = plan.as_dict()
        if job is not None:
            answer["script_batch"] = {
                "global_batch": job.global_batch, "workers": job.workers,
                "replicas_per_worker": job.replicas, "micro_batches": job.micro_batches,
                "batch_mode": job.batch_mode, "script_batch": job.batch}
        return json.dumps(answer, indent=1)
    lines = plan.explain().split("\n")
    if job is not None and args.global_batch is None:
        lines.insert(1, batch_line(job))   # after the model's line
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code (0, or 2 on bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.script_args and not args.script:
        parser.print_usage(sys.stderr)
        print(f"epl-plan: error: unexpected arguments {args.script_args} "
              f"(arguments after -- are for --script)", file=sys.stderr)
        return 2
    try:
        text = run(args)
    except EPLError as err:
        print(f"epl-plan: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

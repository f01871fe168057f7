"""The schema of EPL's configuration: one `KeySpec` per key, and its table.

`schema()` is the table of every key (type, default, allowed values, range,
one-line doc), grouped by section in EPL's documented order; `SPECS`,
`SECTIONS` and `ENV_VARS` index it by key, by section and by environment
variable (`env_var_name`).  `format_schema` renders it as plain text.  Dict
and list values are stored frozen (`freeze_value`, `thaw_value`,
`hashable_value`).  Checking values against the schema, and the `Config`
objects that hold them, are `epl.config`'s (which re-exports the public names
here: `KeySpec`, `schema`, `format_schema`, `env_var_name`, `ENV_PREFIX`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

ENV_PREFIX = "EPL_"
"""Prefix of the environment variables that override configuration keys."""


# Helpers for dict and list values, which are stored frozen.

def freeze_value(value: Any) -> Any:
    """Copy a dict or list value into a read-only form (mappings, tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: freeze_value(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze_value(item) for item in value)
    return value


def thaw_value(value: Any) -> Any:
    """Turn a frozen value back into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {key: thaw_value(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [thaw_value(item) for item in value]
    return value


def hashable_value(value: Any) -> Any:
    """Return a hashable stand-in for a frozen value."""
    if isinstance(value, Mapping):
        return ("dict", frozenset((key, hashable_value(item)) for key, item in value.items()))
    if isinstance(value, tuple):
        return ("list", tuple(hashable_value(item) for item in value))
    return value


@dataclass(frozen=True)
class KeySpec:
    """The schema entry of one configuration key.

    Attributes:
        key: the dotted name, ``"<section>.<name>"``.
        type: one of ``"bool"``, ``"int"``, ``"float"`` (any real number),
            ``"str"``, ``"dict"``, ``"list"``.
        default: the value a `Config` holds when nothing sets the key.
        doc: one line saying what the key does.
        allowed: for ``str`` keys, the only accepted values (matched without
            regard to case); None accepts any string.
        minimum: for numeric keys, the smallest accepted value; None for none.
        exclusive: True when ``minimum`` itself is not accepted (``> minimum``).
        keywords: strings a numeric key accepts besides numbers
            (``amp.loss_scale`` accepts ``"dynamic"``).
        nullable: None is accepted and stored, meaning "unset" (EPL's
            ``pipeline.num_stages: None``); the environment variable takes
            ``none`` for it.
    """

    key: str
    type: str
    default: Any
    doc: str
    allowed: tuple[str, ...] | None = None
    minimum: float | None = None
    exclusive: bool = False
    keywords: tuple[str, ...] = ()
    nullable: bool = False

    def __post_init__(self) -> None:
        """Freeze a dict or list default so the schema cannot be changed by accident."""
        object.__setattr__(self, "default", freeze_value(self.default))

    @property
    def section(self) -> str:
        """The section part of the key (``"pipeline"``)."""
        return self.key.split(".", 1)[0]

    @property
    def name(self) -> str:
        """The key's name within its section (``"num_micro_batch"``)."""
        return self.key.split(".", 1)[1]

    @property
    def env_var(self) -> str:
        """The environment variable that overrides this key."""
        return env_var_name(self.key)

    def describe_valid(self) -> str:
        """Return a phrase naming the valid values, e.g. ``"an int >= 1"``."""
        if self.allowed is not None:
            return "one of %s" % list(self.allowed)
        noun = {
            "bool": "a bool (True or False)",
            "int": "an int",
            "float": "a number",
            "str": "a str",
            "dict": "a dict",
            "list": "a list",
        }[self.type]
        if self.minimum is not None:
            noun += " %s %s" % (">" if self.exclusive else ">=", _plain(self.minimum))
        if self.keywords:
            noun = " or ".join([repr(word) for word in self.keywords] + [noun])
        if self.nullable:
            noun = "None (unset) or " + noun
        return noun


def env_var_name(key: str) -> str:
    """Return the environment variable for a dotted key.

    ``"pipeline.num_micro_batch"`` gives ``"EPL_PIPELINE_NUM_MICRO_BATCH"``.
    """
    return ENV_PREFIX + key.replace(".", "_").upper()


def _plain(number: float) -> str:
    """Write a bound without a useless ``.0`` (``1`` rather than ``1.0``)."""
    return str(int(number)) if float(number).is_integer() else str(number)


# --------------------------------------------------------------------------
# The schema: one entry per key, grouped by section in EPL's documented order.
# Keys marked "successor" are not in EPL; they belong to this project.
# --------------------------------------------------------------------------

_PIPELINE_STRATEGIES = ("PreferBackward", "PreferForward")

SCHEMA: tuple[KeySpec, ...] = (
    # pipeline
    KeySpec("pipeline.num_micro_batch", "int", 1,
            "Number of micro-batches per step in pipeline parallelism.",
            minimum=1),
    # EPL's documented default None means "unset": no automatic partition (its code
    # wrote -1 and partitioned only for a value > 1); 1 also means one stage.
    KeySpec("pipeline.num_stages", "int", None,
            "Number of pipeline stages when auto.auto_parallel partitions the model "
            "(None: unset, no automatic stages).",
            minimum=1, nullable=True),
    KeySpec("pipeline.strategy", "str", "PreferBackward",
            "Pipeline schedule: PreferBackward (PipeDream-like, 1F1B) or "
            "PreferForward (GPipe-like).",
            allowed=_PIPELINE_STRATEGIES),
    KeySpec("pipeline.unit_functions", "bool", True,
            "Run each micro-batch's and replica's stage forward and backward as one call "
            "of a function they share (the unit_functions pass), so TensorFlow optimizes "
            "each stage once instead of once per copy: a faster first step and less "
            "memory with many micro-batches, for a longer rewrite (the pass reads the "
            "copies it replaces; on bench/startup.py's encoder at 24 layers and 16 "
            "micro-batches, rewrite plus first step is about the copies', 23.0 s against "
            "22.9 s in one run on a loaded machine, the first step under half theirs, "
            "5.6 s against 13.1 s, and the peak memory 1,415 MB against 2,097 MB); the numbers "
            "may differ from the copies by float rounding "
            "(Grappler reassociates arithmetic across a call's boundary differently). Off: "
            "the copies run. Not for tf.function steps."),
    # gradient_checkpoint
    KeySpec("gradient_checkpoint.type", "str", "",
            "How checkpoint tensors are chosen: '' (off), 'collection' "
            "(user's collection), 'auto' (searched).",
            allowed=("", "collection", "auto")),
    KeySpec("gradient_checkpoint.end_taskgraph", "int", -1,
            "Index of the last TaskGraph that auto gradient checkpointing "
            "applies to (-1 = the last one)."),
    KeySpec("gradient_checkpoint.check_gradients", "bool", False,
            "Check the recomputed gradients against the gradients without "
            "checkpointing."),
    # zero
    # EPL's v0 partitions the optimizer states only (gradients all-reduced); here
    # 'v0' runs the same sharding as 'v1' (same updates, less memory and traffic).
    KeySpec("zero.level", "str", "",
            "ZeRO level: '' (off) or 'v1' (partition optimizer states and the "
            "update across data-parallel replicas; gradients are reduce-scattered); "
            "'v0' (EPL: optimizer states only) runs as 'v1'.",
            allowed=("", "v0", "v1")),
    # offload
    KeySpec("offload.level", "str", "",
            "Weight offload level: '' (off) or 'v0' (keep all weights in CPU memory).",
            allowed=("", "v0")),
    # amp
    KeySpec("amp.level", "str", "",
            "Automatic mixed precision level: '' (off) or 'O1'.",
            allowed=("", "O1")),
    KeySpec("amp.debug_log", "bool", False,
            "Log which ops automatic mixed precision casts."),
    KeySpec("amp.loss_scale", "float", "dynamic",
            "Loss scale for mixed precision: 'dynamic' or a fixed positive number.",
            minimum=0, exclusive=True, keywords=("dynamic",)),
    KeySpec("amp.dtype", "str", "float16",  # successor
            "Low-precision dtype for automatic mixed precision.",
            allowed=("float16", "bfloat16")),
    # optimizer
    KeySpec("optimizer.num_apply_group", "int", 1,
            "Number of groups the gradient apply is split into, to cap the "
            "peak memory of temporaries.",
            minimum=1),
    # cluster
    KeySpec("cluster.device_place_prefer_intra_node", "bool", True,
            "Prefer placing one model replica within one node."),
    KeySpec("cluster.run_visible_devices", "str", "",
            "Visible devices for the session; usually set by the scheduler."),
    KeySpec("cluster.colocate_split_and_replicate", "bool", False,
            "Place split and replicate TaskGraphs on the same devices."),
    KeySpec("cluster.virtual_devices", "int", 4,  # successor
            "Number of virtual CPU devices per worker on a machine without "
            "accelerators.",
            minimum=1),
    KeySpec("cluster.device_profiles", "dict", {},  # successor
            "Overrides of device profiles (by device or profile name) for "
            "the planner."),
    # split (successor)
    KeySpec("split.moe_chunks", "int", 1,
            "Chunks each expert dispatch of epl.split is cut into along the tokens' "
            "capacity axis, so that the all-to-all of chunk i+1 overlaps the expert "
            "compute of chunk i (Tutel's and FasterMoE's pipelining); must divide the "
            "capacity. 1 = one exchange; epl-plan prints the count its cost model "
            "predicts fastest.",
            minimum=1),
    # communication
    KeySpec("communication.num_communicators", "int", 2,
            "Number of communicators in the communication pool.",
            minimum=1),
    KeySpec("communication.sparse_as_dense", "bool", False,
            "Convert sparse gradients to dense tensors before communication."),
    KeySpec("communication.max_splits", "int", 5,
            "Most buckets the gradients of one device and dtype are fused into "
            "(raises communication.fusion_threshold_mb where needed; 0 = no limit).",
            minimum=0),
    KeySpec("communication.fusion_threshold_mb", "float", 128.0,  # successor
            "Size in MiB at which a gradient fusion buffer is closed.",
            minimum=0, exclusive=True),
    KeySpec("communication.fp16", "bool", False,
            "Compress gradients to float16 for all-reduce."),
    # EPL documents an integer; any positive number is accepted here.
    KeySpec("communication.fp16_scale", "float", 128.0,
            "Scale applied to gradients around float16 all-reduce.",
            minimum=0, exclusive=True),
    # EPL's False clipped each replica's gradients before the all-reduce; here the
    # reduced gradients are always clipped (docs/differences-from-epl.md).
    KeySpec("communication.clip_after_allreduce", "bool", False,
            "Accepted for EPL's scripts; no effect: gradients are always clipped after "
            "they are reduced (the same update as single-device training)."),
    KeySpec("communication.gradients_reduce_method", "str", "mean",
            "How replicas' gradients are combined: 'mean' or 'sum'.",
            allowed=("mean", "sum")),
    KeySpec("communication.collective_timeout_s", "float", 300.0,  # successor
            "Seconds a collective may wait for its peers before failing.",
            minimum=0, exclusive=True),
    KeySpec("communication.local_reduction", "str", "auto",  # successor
            "How a worker's devices all-reduce: 'collective' (TensorFlow's collective "
            "ops: NCCL among GPUs, a ring otherwise), 'one_device' (the sum on the first "
            "device, read by the others: MirroredStrategy's ReductionToOneDevice), or "
            "'auto' ('one_device' on CPU devices, which share one memory, else "
            "'collective').",
            allowed=("auto", "collective", "one_device")),
    # io
    KeySpec("io.slicing", "bool", False,
            "Slice the input files among data-parallel workers automatically."),
    KeySpec("io.unbalanced_io_slicing", "bool", False,
            "Allow workers to get unequal numbers of input files."),
    KeySpec("io.drop_last_files", "bool", False,
            "Drop the input files left over after an even split among workers."),
    KeySpec("io.batch_mode", "str", "replica",  # successor
            "What the script's batch is: 'replica' (EPL's contract: one replica's "
            "micro-batch; each replica and micro-batch draws its own) or 'global' (the "
            "worker's whole batch, sliced among its replicas and micro-batches).",
            allowed=("replica", "global")),
    # batch_norm (successor)
    KeySpec("batch_norm.moving_statistics", "str", "replica0",
            "What moves batch norm's moving mean and variance (the writes in "
            "tf.GraphKeys.UPDATE_OPS), once per step on every replica: 'replica0' (the "
            "first replica's first micro-batch, Horovod's rank 0) or 'mean' (the mean over "
            "every replica and micro-batch, MirroredStrategy's).",
            allowed=("replica0", "mean")),
    # auto
    KeySpec("auto.auto_parallel", "bool", False,
            "Let the planner choose the parallel strategy (experimental)."),
    # debug (successor)
    KeySpec("debug.dump_dir", "str", "",
            "Directory for graph dumps after every pass ('' = no dumps)."),
    KeySpec("debug.check_invariants", "bool", False,
            "Check graph invariants between passes, and each pass's modified flag against "
            "a graph fingerprint."),
    KeySpec("debug.disabled_passes", "list", [],
            "Names of passes to leave off (as TVM's disabled_pass), for debugging a rewrite; "
            "a pass another enabled pass needs cannot be disabled."),
    KeySpec("debug.log_level", "str", "",
            "Level of the stream handler epl.init attaches to the 'epl' logger ('' = leave "
            "logging to the application).",
            allowed=("", "DEBUG", "INFO", "WARNING", "ERROR")),
    KeySpec("debug.log_all_ranks", "bool", False,
            "Print the parallel-graph summary and ProgressHook's lines on every worker "
            "(default: worker 0 only, as Horovod scripts print)."),
    KeySpec("debug.whole_graph_sessions", "bool", False,
            "Let a session of a rewritten graph run the whole graph, as TensorFlow's "
            "sessions do. Default: it runs a graph of the ops its runs need, copied in "
            "before each run (epl/runtime/run_graph.py): TensorFlow copies a session's "
            "whole graph at each new set of fetches, and a rewritten graph keeps the "
            "copies the unit functions replaced and the model as built, which no run "
            "reads (at 24 layers and 16 micro-batches of bench/startup.py's encoder, "
            "108,530 ops of which a training run needs about 12,000)."),
    KeySpec("debug.trace_dir", "str", "",
            "Directory for Chrome traces (chrome://tracing, Perfetto) of the training "
            "steps in debug.trace_steps ('' = no traces)."),
    KeySpec("debug.trace_steps", "list", [2],
            "Training runs to trace with debug.trace_dir, counted from 1 per graph "
            "(the first run includes TensorFlow's warm-up)."),
)

SPECS: dict[str, KeySpec] = {spec.key: spec for spec in SCHEMA}
SECTIONS: dict[str, tuple[KeySpec, ...]] = {}
for _spec in SCHEMA:
    SECTIONS[_spec.section] = SECTIONS.get(_spec.section, ()) + (_spec,)
del _spec
ENV_VARS: dict[str, KeySpec] = {spec.env_var: spec for spec in SCHEMA}


def schema() -> tuple[KeySpec, ...]:
    """Return the schema: one `KeySpec` per key, grouped by section."""
    return SCHEMA


def format_schema() -> str:
    """Return the schema as a plain-text table: key, type, default, valid values, doc."""
    rows = [("key", "type", "default", "valid", "doc")]
    for spec in SCHEMA:
        rows.append((spec.key, spec.type, repr(thaw_value(spec.default)), spec.describe_valid(),
                     spec.doc))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        lines.append("  ".join(cells + [row[4]]).rstrip())
    return "\n".join(lines)

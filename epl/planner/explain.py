"""The report text of a plan: what `ClusterPlan.explain()` and `as_dict()` give.

`explain_text` renders the model, the cluster and its network, the chosen
plan with its per-device table (identical rows collapsed) and every
alternative with its predicted step time or the constraint that ruled it
out; `plan_dict` is the same as JSON-ready data (`epl-plan --json`).
Formatting only: every figure comes from the plan (a
`epl.planner.search.ClusterPlan`, passed in as `plan`).
"""
from __future__ import annotations

import math
from typing import Any

from epl.planner.balance import index_ranges
from epl.planner.devices import DeviceLayout, merge_runs, runs_count, runs_text
from epl.planner.model_spec import ModelSpec
from epl.planner.results import CHOICE_TOLERANCE, Alternative, DeviceLoad
from epl.planner.step_cost import cluster_link, slowest_link
from epl.planner.profiles import HostNetwork

def _ms(seconds: float) -> str:
    """Seconds as milliseconds: one decimal, or 3 significant digits below
    10 ms."""
    ms = seconds * 1e3
    if ms == 0 or ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.3g}"


def _flops_text(flops: float) -> str:
    """"70.2 GFLOP", "812 kFLOP"..."""
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"),
                        (1e6, "MFLOP"), (1e3, "kFLOP")):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size_text(nbytes: float) -> str:
    """Bytes in the binary unit that suits the value: "0", "512 B",
    "3.2 KiB", "419.3 MiB", "30.4 GiB", "1.5 TiB" (one decimal, the
    figure below 1024 of its unit)."""
    if nbytes <= 0:
        return "0"
    value, unit = float(nbytes), 0
    while value >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{value:.0f} B"
    if round(value, 1) >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{value:.1f} {_BINARY_UNITS[unit]}"


_num = size_text


def _table(plan: Any, alt: Alternative) -> list[str]:
    """The per-device table of `alt`, identical rows collapsed."""
    offload = plan.options.offload
    split = plan.model.split_units > 0
    pipeline = alt.pipeline_stages > 1
    header = ["devices", "hosts", "profile", "batch"]
    header += ["shards"] if split else []
    header += ["stage", "layers"] if pipeline else []
    header += ["params", "grads", "optim", "activ", "total/usable"]
    header += ["host/usable"] if offload else []
    header += ["compute ms", "comm ms"]
    wait = any(load.wait_s for load in alt.rows)
    header += ["wait ms"] if wait else []
    header += ["count"]
    rows: dict[tuple, list[tuple[int, int]]] = {}
    for load in alt.rows:
        row = [load.device.profile.name, str(load.batch)]
        row += [str(load.shards)] if split else []
        if pipeline:
            a, b = load.layers
            row += [str(load.stage), f"{a}-{b - 1}"]
        row += [_num(load.parameters), _num(load.gradients),
                _num(load.optimizer), _num(load.activations),
                f"{_num(load.total)}/{_num(load.usable)}"]
        row += [f"{_num(load.host_bytes)}/{_num(load.host_usable)}"] \
            if offload else []
        row += [_ms(load.compute_s), _ms(load.comm_s)]
        row += [_ms(load.wait_s)] if wait else []
        rows.setdefault(tuple(row), []).extend(load.device_runs)
    layout = alt.layout if alt.layout is not None else \
        DeviceLayout(plan.hosts)
    body = []
    for row, runs in rows.items():
        runs = merge_runs(runs)
        body.append([runs_text(runs), runs_text(layout.host_runs(runs)),
                     *row, str(runs_count(runs))])
    return _columns([header] + body)


def _columns(rows: list[list[str]]) -> list[str]:
    """Left-aligned text columns."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in rows]


def _cluster_line(plan: Any) -> str:
    """"Cluster: 2 hosts, 8 devices (...); slowest link ..."."""
    layout = DeviceLayout(plan.hosts)
    groups: list[list] = []
    for h, host in enumerate(plan.hosts):
        if groups and groups[-1][1] == host.profile.name and \
                groups[-1][2] == host.devices:
            groups[-1][0].append(h)
        else:
            groups.append([[h], host.profile.name, host.devices])
    parts = [f"host{'s' if len(hs) > 1 else ''} {index_ranges(hs)}: "
             f"{count} x {name}" for hs, name, count in groups]
    bandwidth, kind = slowest_link([c.representative for c in layout.classes]
                                   ) if len(plan.hosts) == 1 else \
        cluster_link(layout)
    return (f"Cluster: {len(plan.hosts)} host(s), {len(layout)} devices "
            f"({'; '.join(parts)}); slowest link {bandwidth / 1e9:.1f} GB/s "
            f"({kind})")




def _network_line(plan: Any) -> str:
    """"Network per host: hosts 0-1: 8 x 200 Gb/s (200.0 GB/s); ..."."""
    groups: list[tuple[list[int], HostNetwork]] = []
    for h, host in enumerate(plan.hosts):
        if groups and groups[-1][1] == host.network:
            groups[-1][0].append(h)
        else:
            groups.append(([h], host.network))
    parts = [f"host{'s' if len(hs) > 1 else ''} {index_ranges(hs)}: "
             f"{network}" for hs, network in groups]
    unused = "; one host: not used" if len(plan.hosts) == 1 else ""
    return f"Network per host: {'; '.join(parts)}{unused}"


def _model_line(plan: Any) -> str:
    """One line describing the model."""
    m = plan.model
    params = m.num_parameters
    count = f"{params / 1e12:.2f} T" if params >= 1e12 else \
        f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    split = f", {m.split_units} experts per split layer" if m.split_units \
        else ""
    size = size_text(m.parameter_bytes)
    return (f"Model: {m.name}: {_layers_text(m)}, {count} parameters "
            f"({size}){split}; "
            f"{_flops_text(m.flops_per_example)} per example (forward + "
            f"backward); optimizer {plan.optimizer}; global batch "
            f"{plan.global_batch}; compute dtype "
            f"{plan.options.compute_dtype or m.compute_dtype}"
            + ("; parameters and optimizer state offloaded to host memory"
               if plan.options.offload else ""))


def _layers_text(m: ModelSpec, shown: int = 6) -> str:
    """"3 layers (hidden1, hidden2, logits) in 1 TaskGraph", or "14 layer(s)"."""
    if not m.model_layers:
        return f"{len(m.layers)} layer(s)"
    names = list(m.model_layers)
    listed = ", ".join(names[:shown]) + (f", ... (+{len(names) - shown} more)"
                                         if len(names) > shown else "")
    return (f"{len(names)} layer{'' if len(names) == 1 else 's'} ({listed}) in "
            f"{len(m.layers)} TaskGraph{'' if len(m.layers) == 1 else 's'}")


def _alternative_line(plan: Any, alt: Alternative) -> str:
    """One line per alternative: time and verdict."""
    if alt is plan.chosen:
        verdict = "chosen"
    elif alt.feasible:
        ratio = alt.step_time / plan.chosen.step_time
        verdict = f"fits, not chosen: {ratio:.2f}x the chosen step time"
        if alt.step_time < plan.chosen.step_time:
            verdict += (f" (within the {CHOICE_TOLERANCE:.0%} simplicity "
                        f"margin: a plan listed earlier is chosen unless "
                        f"a later one is more than {CHOICE_TOLERANCE:.0%} "
                        f"faster)")
    else:
        verdict = f"rejected: {alt.reason}"
    time = f"{_ms(alt.step_time)} ms" if alt.feasible else "-"
    return f"  {alt.name:<58} {time:>12}  {verdict}"


def explain_text(plan: Any) -> str:
    """The text of ClusterPlan.explain() for `plan` (a ClusterPlan)."""
    chosen = plan.chosen
    lines = [_model_line(plan), _cluster_line(plan), _network_line(plan),
             ""]
    slowest = max(chosen.rows, key=lambda load: load.step_s)
    wait = f", waiting {_ms(slowest.wait_s)} ms" if slowest.wait_s else ""
    lines.append(f"Chosen plan: {chosen.name}: predicted step "
                 f"{_ms(chosen.step_time)} ms (slowest device: compute "
                 f"{_ms(slowest.compute_s)} ms{wait}, communication "
                 f"{_ms(slowest.comm_s)} ms)")
    if chosen.pipeline_stages > 1:
        lines.append(f"  {chosen.num_micro_batch} micro-batches per step; "
                     f"earlier stages on devices with more memory")
    lines.append(f"  batch sizes per replica: {_batch_summary(chosen)}")
    chunks = max((load.moe_chunks for load in chosen.rows), default=1)
    if chunks > 1:
        lines.append(f"  expert dispatch in {chunks} chunks, each chunk's "
                     f"all-to-all overlapping the previous chunk's expert "
                     f"compute (split.moe_chunks={chunks})")
    lines.append("")
    lines += _table(plan, chosen)
    lines.append("")
    lines.append("Alternatives (predicted step time):")
    lines += [_alternative_line(plan, alt) for alt in plan.alternatives]
    notes = list(plan.model.notes)
    if chosen.pipeline_stages > 1:
        notes.append("pipeline: the activations sent between stages are "
                     "not counted in communication")
    if any(load.wait_s for load in chosen.rows):
        notes.append("wait: every split layer's all-to-all is a barrier, so "
                     "a device idles until the slowest device's replicated "
                     "work, and then its expert work, is done")
    if plan.options.offload:
        notes.append("offload: params and grads on the device are working "
                     "buffers (the largest layer's, parameters double-"
                     "buffered); host GB holds parameters, gradients and "
                     "optimizer state; the optimizer update runs on the "
                     "host; comm includes host <-> device copies at "
                     f"{plan.options.host_link_bandwidth / 1e9:.0f} GB/s")
    if plan.model.unknown_op_types:
        notes.append("op types the cost model does not know (their bytes "
                     "are counted, no FLOPs): " + unknown_op_text(plan.model))
    notes.append("sizes in binary units (KiB, MiB, GiB); usable = "
                 f"{plan.options.usable_fraction:.0%} of device memory; "
                 f"compute at {plan.options.efficiency:.0%} of peak; "
                 "communication not overlapped with compute"
                 + (" (but for the chunked expert dispatch)"
                    if chunks > 1 else ""))
    lines.append("")
    lines += [f"Note: {note}" for note in notes]
    return "\n".join(lines)


def unknown_op_text(model: ModelSpec) -> str:
    """"Foo x3, Bar x1": the model's unknown op types with their counts."""
    return ", ".join(f"{name} x{count}"
                     for name, count in model.unknown_op_types)


def _batch_summary(alt: Alternative) -> str:
    """Batch sizes as "86 x4, 42 x4" (runs of equal values)."""
    runs = alt.batch_runs
    return ", ".join(f"{s} x{c}" if c > 1 else str(s) for s, c in runs) + \
        f" (sum {sum(s * c for s, c in runs)})"


def _row_dict(layout: DeviceLayout, load: DeviceLoad) -> dict:
    """One row of the JSON table."""
    runs = merge_runs(load.device_runs)
    row = {"devices": runs_text(runs),
           "hosts": runs_text(layout.host_runs(runs)),
           "count": runs_count(runs), "profile": load.device.profile.name,
           "batch": load.batch, "shards": load.shards, "stage": load.stage,
           "layers": list(load.layers) if load.layers else None,
           "parameter_bytes": load.parameters,
           "gradient_bytes": load.gradients,
           "optimizer_bytes": load.optimizer,
           "activation_bytes": load.activations,
           "total_bytes": load.total, "usable_bytes": load.usable,
           "compute_s": load.compute_s, "comm_s": load.comm_s,
           "wait_s": load.wait_s, "step_s": load.step_s, "fits": load.fits}
    if load.host_bytes or math.isfinite(load.host_usable):
        row["host_bytes"] = load.host_bytes
        row["host_usable_bytes"] = load.host_usable
    return row


def plan_dict(plan: Any) -> dict:
    """ClusterPlan.as_dict() for `plan` (a ClusterPlan)."""
    layout = plan.chosen.layout if plan.chosen.layout is not None else \
        DeviceLayout(plan.hosts)
    m = plan.model
    alternatives = []
    for alt in plan.alternatives:
        entry = {"name": alt.name, "feasible": alt.feasible,
                 "step_time_s": alt.step_time if alt.feasible else None,
                 "chosen": alt is plan.chosen}
        if alt.feasible:
            entry["ratio_to_chosen"] = alt.step_time / plan.chosen.step_time
        else:
            entry["rejected_because"] = alt.reason
        alternatives.append(entry)
    return {
        "model": {"name": m.name, "layers": len(m.layers),
                  "model_layers": list(m.model_layers),
                  "parameters": m.num_parameters,
                  "parameter_bytes": m.parameter_bytes,
                  "flops_per_example": m.flops_per_example,
                  "split_units": m.split_units,
                  "compute_dtype": plan.options.compute_dtype
                  or m.compute_dtype, "exact": m.exact,
                  "unknown_op_types": {name: count for name, count
                                       in m.unknown_op_types},
                  "notes": list(m.notes)},
        "cluster": {"hosts": len(plan.hosts), "devices": len(layout),
                    "groups": [{"devices": runs_text(c.runs),
                                "hosts": runs_text(layout.host_runs(c.runs)),
                                "count": c.count, "profile": c.profile.name,
                                "devices_per_host": c.per_host,
                                "network_bytes_per_s": c.network.bandwidth}
                               for c in layout.classes]},
        "optimizer": plan.optimizer, "global_batch": plan.global_batch,
        "chosen": {"name": plan.chosen.name,
                   "step_time_s": plan.chosen.step_time,
                   "batch_sizes": [{"batch": size, "replicas": count}
                                   for size, count in plan.chosen.batch_runs],
                   "moe_chunks": max((row.moe_chunks
                                      for row in plan.chosen.rows),
                                     default=1),
                   "rows": [_row_dict(layout, row)
                            for row in plan.chosen.rows]},
        "choice_rule": {"simplicity_margin": CHOICE_TOLERANCE,
                        "rule": "the earliest listed alternative that fits "
                                "and is within the margin of the fastest "
                                "one's step time"},
        "alternatives": alternatives,
    }

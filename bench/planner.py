"""Benchmark of the hardware-aware planner on simulated mixed clusters.

For each cluster (V100 + T4; A100 + V100; 8 fast + 8 slow over 4 hosts) and
each built-in model (BERT-base, ResNet-50, M6-mini), all in mixed precision
(float16 compute), it plans the same global batch twice, side by side:

- the peer: data parallelism with an even split of the batch (what a
  hardware-unaware framework does);
- EPL: data parallelism balanced by capability within memory
  (epl.planner.balance.balance_batch), and the plan the planner chooses.

It prints a table and one ratio line per case: predicted step time of the
even split / the balanced plan (target >= 1.3 where the capability gap, the
slow device's predicted compute time over the fast one's at equal batch, is
at least 2x), a line counting the rows that meet and miss the target, and
checks that no balanced plan runs out of memory where the even split fits.
"comm" is the share of communication (gradient all-reduce, expert
all-to-all) in the even split's step on its slowest device: balancing
cannot shorten it, so it bounds the ratio.  Both plans of a row cut the
expert dispatch into the chunks the planner's model predicts fastest
(`split.moe_chunks`, `epl.planner.step_cost.exposed_alltoall_time`: each
chunk's all-to-all overlapping the previous chunk's expert compute); the
chosen plan names the count, and a row that misses the target also gives
both plans unchunked.  For a row that misses the
target, the ratio line adds the fastest plan an exhaustive search finds
(`exhaustive_best`: every split of the experts and of the batch between the
two device kinds, through the planner's own cost model), to tell a search
that falls short from a cluster that cannot do better.

It does so twice, for the same clusters with two networks:

1. every host with its server's published compute network
   (`NETWORKED_CLUSTERS`, cited in epl/planner/profiles.py): A100 hosts like an
   NVIDIA DGX A100, one 200 Gb/s HDR InfiniBand NIC per GPU (8 x 200 Gb/s
   for 8 GPUs; 4 x 200 Gb/s for the 4-GPU hosts); 8-GPU V100 hosts like an
   NVIDIA DGX-1 with V100, 4 x 100 Gb/s EDR InfiniBand (a DGX-2 has the same
   4 NICs per 8 GPUs: 8 x 100 Gb/s for 16); T4 hosts with one 100 Gb/s NIC,
   the most cloud T4 machines get.  Its ratio lines are tagged
   "published networks".
2. every host linked by the profiles' default network, one 100 Gb/s NIC
   per host, whatever its GPUs (tagged "one NIC per host").  M6-mini's
   expert all-to-all then takes half or more of the even split's step, and
   balancing, which shortens compute, gains less.

Then the M6-10T configuration (~9.9 T parameters) on 512 V100-32GB with
offload: its per-device memory table and whether it fits, and what the
planner says without offload.

The predictions come from the cost model (no accelerator is used), so the
numbers are deterministic; "timings are medians" does not apply.

    python bench/planner.py
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from epl.errors import ClusterError  # noqa: E402
from epl.planner import balance  # noqa: E402
from epl.planner import data_parallel, search, step_cost  # noqa: E402
from epl.planner.results import memory_reason  # noqa: E402
from epl.planner.planner import PlanOptions, plan_cluster  # noqa: E402
from epl.planner.profiles import parse_cluster  # noqa: E402
from epl.tools.plan import builtin_model  # noqa: E402

CLUSTERS = [
    ("V100+T4", "1x8xV100-32GB,1x8xT4"),
    ("A100+V100", "1x8xA100-40GB,1x8xV100-32GB"),
    ("8 fast + 8 slow", "2x4xA100-80GB,2x4xT4"),
]
#: Per-NIC networks of the servers (see the docstring and epl/planner/profiles.py).
DGX_A100_NIC = "200Gbps"  # one HDR InfiniBand NIC per GPU
DGX1_V100 = "4x100Gbps"  # DGX-1 with V100: 4 x EDR InfiniBand for 8 GPUs
T4_SERVER = "1x100Gbps"
#: The same clusters, each host with its server's published network.
NETWORKED_CLUSTERS = [
    ("V100+T4", f"1x8xV100-32GB@{DGX1_V100},1x8xT4@{T4_SERVER}"),
    ("A100+V100", f"1x8xA100-40GB@8x{DGX_A100_NIC},"
                  f"1x8xV100-32GB@{DGX1_V100}"),
    ("8 fast + 8 slow", f"2x4xA100-80GB@4x{DGX_A100_NIC},"
                        f"2x4xT4@{T4_SERVER}"),
]
#: model -> examples per device (typical mixed-precision training batches).
MODELS = [("bert-base", 128), ("resnet50", 128), ("m6-mini", 64)]
DTYPE = "float16"
EVEN = "data-parallel, even split"
BALANCED = "data-parallel, balanced by capability"
TARGET = 1.3


def _case(cluster: str, model_name: str, per_device: int) -> dict:
    """Plan one (cluster, model); the figures of the table row."""
    hosts = parse_cluster(cluster)
    batch = per_device * sum(h.devices for h in hosts)
    plan = plan_cluster(builtin_model(model_name, DTYPE), hosts, "adam",
                        batch, PlanOptions(compute_dtype=DTYPE))
    even, balanced = plan.alternative(EVEN), plan.alternative(BALANCED)
    computes = [load.compute_s for load in even.loads]
    slowest = max(even.loads, key=lambda load: load.step_s)
    case = {
        "batch": batch,
        "gap": max(computes) / min(computes),
        "comm": slowest.comm_s / slowest.step_s,
        "even": even, "balanced": balanced, "chosen": plan.chosen,
    }
    if _chunks(balanced) > 1:  # the same plans with the dispatch unchunked
        whole = plan_cluster(builtin_model(model_name, DTYPE), hosts, "adam",
                             batch, PlanOptions(compute_dtype=DTYPE,
                                                moe_chunks=1))
        case["unchunked"] = (whole.alternative(EVEN),
                             whole.alternative(BALANCED))
    return case


def _chunks(alt) -> int:
    """The chunk count of an alternative's expert dispatch (split.moe_chunks)."""
    return max((load.moe_chunks for load in alt.rows), default=1)


def exhaustive_best(cluster: str, model_name: str, per_device: int
                    ) -> float | None:
    """The fastest data-parallel plan of a two-kind cluster, by brute force.

    Every split of the experts between the two device kinds (spread evenly
    within a kind, at least one per device) and every split of the batch
    (whole examples per device of the first kind, the rest spread over the
    second), each evaluated with the planner's own cost model
    (`_dp_loads`); returns the shortest predicted step (seconds) among
    those that fit, or None for a cluster without exactly two kinds or a
    model without split layers.  A check of the planner's search, which
    tries far fewer assignments, not a planner.
    """
    model = builtin_model(model_name, DTYPE)
    hosts = parse_cluster(cluster)
    batch = per_device * sum(h.devices for h in hosts)
    ctx = search._context(model, hosts, "adam", batch,
                               PlanOptions(compute_dtype=DTYPE))
    kinds = sorted({d.profile.name for d in ctx.devices})
    units = model.split_units
    if len(kinds) != 2 or not units:
        return None
    totals = step_cost.layer_totals(model.layers, False)
    first = [i for i, d in enumerate(ctx.devices)
             if d.profile.name == kinds[0]]
    second = [i for i in range(len(ctx.devices)) if i not in first]
    best = None
    for on_first in range(len(first), units - len(second) + 1):
        placement = [0] * len(ctx.devices)
        for group, total in ((first, on_first), (second, units - on_first)):
            even = balance.proportional_shares(total, [1.0] * len(group))
            for i, u in zip(group, even):
                placement[i] = u
        states = [data_parallel._device_state(ctx, totals, u, len(placement),
                                                   False) for u in placement]
        for each in range(batch // len(first) + 1):
            sizes = [0] * len(ctx.devices)
            for i in first:
                sizes[i] = each
            rest = batch - each * len(first)
            even = balance.proportional_shares(rest, [1.0] * len(second))
            for i, b in zip(second, even):
                sizes[i] = b
            loads = data_parallel._dp_loads(ctx, totals, placement, states,
                                                 sizes)
            if memory_reason(loads):
                continue
            step = max(load.step_s for load in loads)
            best = step if best is None else min(best, step)
    return best


def _ms(alt) -> str:
    """Step time in ms, or OOM."""
    return f"{alt.step_time * 1e3:.1f}" if alt.feasible else "OOM"


def mixed_clusters(clusters=CLUSTERS, tag: str = "") -> list[str]:
    """The cluster x model table and its ratio lines (tagged with `tag`)."""
    header = (f"{'cluster':<16} {'model':<10} {'batch':>6} {'gap':>5} "
              f"{'comm':>5} "
              f"{'even ms':>9} {'balanced ms':>12} {'chosen ms':>10}  "
              f"{'ratio':>6}  chosen plan")
    rows, ratios = [header, "-" * len(header)], []
    bad_oom, meets, misses = 0, [], []
    for cluster_name, cluster in clusters:
        for model_name, per_device in MODELS:
            case = _case(cluster, model_name, per_device)
            even, balanced = case["even"], case["balanced"]
            if even.feasible and not balanced.feasible:
                bad_oom += 1
            ratio = even.step_time / balanced.step_time \
                if even.feasible and balanced.feasible else None
            rows.append(
                f"{cluster_name:<16} {model_name:<10} {case['batch']:>6} "
                f"{case['gap']:>4.2f}x {case['comm']:>5.0%} "
                f"{_ms(even):>9} {_ms(balanced):>12} "
                f"{_ms(case['chosen']):>10}  "
                f"{(f'{ratio:.2f}x' if ratio else '-'):>6}  "
                f"{case['chosen'].name}"
                + (f", dispatch in {_chunks(case['chosen'])} chunks"
                   if _chunks(case["chosen"]) > 1 else ""))
            name = f"{cluster_name}, {model_name}"
            if ratio is not None and case["gap"] >= 2 and ratio < TARGET:
                case["exhaustive"] = exhaustive_best(cluster, model_name,
                                                     per_device)
            ratios.append(_ratio_line(f"{name}, {tag}" if tag else name,
                                      case, ratio))
            if ratio is not None and case["gap"] >= 2:
                (meets if ratio >= TARGET else misses).append(name)
    rows.append("")
    rows += ratios
    rows.append(f"target >= {TARGET} where the gap is >= 2x"
                f"{f' ({tag})' if tag else ''}: {len(meets)} of "
                f"{len(meets) + len(misses)} rows meet"
                + (f"; misses: {'; '.join(misses)}" if misses else ""))
    rows.append(f"balanced plans out of memory where the even split fits: "
                f"{bad_oom} (target 0)")
    return rows


def _ratio_line(label: str, case: dict, ratio: float | None) -> str:
    """"ratio even/balanced [cluster, model]: 1.52x (gap 2.5x, target ...)"."""
    if ratio is None:
        why = "even split runs out of memory" if not case["even"].feasible \
            else "balanced plan runs out of memory"
        return (f"ratio even/balanced [{label}]: n/a ({why}; "
                f"balanced {'fits' if case['balanced'].feasible else 'OOM'})")
    if case["gap"] >= 2:
        verdict = "meets" if ratio >= TARGET else "MISSES"
        target = f"target >= {TARGET}: {verdict}"
        if ratio < TARGET:
            target += (f"; communication, the same on every device, is "
                       f"{case['comm']:.0%} of the even split's step")
            unchunked = case.get("unchunked")
            if unchunked:
                even, balanced = unchunked
                target += (f"; with the dispatch in "
                           f"{_chunks(case['balanced'])} chunks (split."
                           f"moe_chunks) on both sides; unchunked: "
                           f"{even.step_time * 1e3:.1f} / "
                           f"{balanced.step_time * 1e3:.1f} ms = "
                           f"{even.step_time / balanced.step_time:.2f}x; "
                           f"chunked balanced vs unchunked even: "
                           f"{even.step_time / case['balanced'].step_time:.2f}x")
            best = case.get("exhaustive")
            if best:
                target += (f"; the fastest plan of an exhaustive search "
                           f"(experts and examples per device kind): "
                           f"{best * 1e3:.1f} ms, "
                           f"{case['even'].step_time / best:.2f}x")
    else:
        target = "gap < 2x: no target"
    return (f"ratio even/balanced [{label}]: {ratio:.2f}x "
            f"(capability gap {case['gap']:.2f}x, {target})")


def m6_10t() -> list[str]:
    """M6-10T on 512 V100-32GB with offload; and without."""
    model = builtin_model("m6-10t")
    hosts = parse_cluster("64x8xV100-32GB")
    batch = 2 * 512
    lines = [f"M6-10T: {model.num_parameters / 1e12:.2f} T parameters, "
             f"512 x V100-32GB, global batch {batch}, offload"]
    plan = plan_cluster(model, hosts, "adam", batch,
                        PlanOptions(offload=True))
    lines += ["  " + line for line in plan.explain().splitlines()]
    lines.append(f"M6-10T with offload fits: {plan.chosen.feasible} "
                 f"({plan.chosen.name}, predicted step "
                 f"{plan.chosen.step_time:.2f} s)")
    try:
        plan_cluster(model, hosts, "adam", batch, PlanOptions())
        lines.append("M6-10T without offload fits: True")
    except ClusterError as err:
        text = str(err).splitlines()
        lines.append("M6-10T without offload fits: False")
        lines += ["  " + line for line in text[:6]]
    return lines


def main() -> int:
    """Run both parts and print them."""
    start = time.perf_counter()
    print(f"Planner: predicted step time, even split vs balanced by "
          f"capability ({DTYPE} compute, adam)")
    print("1. published networks: A100 hosts like a DGX A100 (one 200 Gb/s "
          "HDR NIC per GPU), V100 hosts like a DGX-1 (4 x 100 Gb/s EDR), "
          "T4 hosts 1 x 100 Gb/s")
    for cluster_name, cluster in NETWORKED_CLUSTERS:
        print(f"  {cluster_name}: {cluster}")
    for line in mixed_clusters(NETWORKED_CLUSTERS, "published networks"):
        print(line)
    print()
    print("2. one 100 Gb/s NIC per host (the profiles' default; a thin "
          "network for 8 GPUs)")
    for line in mixed_clusters(CLUSTERS, "one NIC per host"):
        print(line)
    print()
    for line in m6_10t():
        print(line)
    print(f"\nbench/planner.py ran in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

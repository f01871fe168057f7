"""The cluster's devices, and groups of identical ones (no TensorFlow).

A cluster of 100,000 hosts of 8 GPUs has 800,000 devices, but a few kinds of
device: the planner works per group of identical devices wherever the
devices of a group are treated alike, and its report shows one row per
group.

- `ClusterDevice`: one device (global index, host, index in the host,
  profile, host network).
- `DeviceLayout`: every device of a list of hosts, numbered host by host,
  as a sequence that makes each `ClusterDevice` only when asked for it, and
  its `classes`.
- `DeviceClass`: the devices that are identical for the planner: the same
  profile, on hosts with the same number of devices and the same network.
  Its members are runs of device indices (consecutive identical hosts make
  one run), so a class of 800,000 devices is a few numbers.
- `runs_text` / `host_runs`: device and host index runs written "0-7,16-23".
"""
from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Sequence

from epl.errors import ClusterError
from epl.planner.profiles import DeviceProfile, HostNetwork, HostSpec

#: Device index runs: (first, end) pairs, end exclusive, sorted.
Runs = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class ClusterDevice:
    """One device of the cluster: global index, host, index in the host,
    profile, and its host's network (None: one NIC at the profile's
    inter_node_bandwidth, as HostSpec's default)."""

    index: int
    host: int
    local: int
    profile: DeviceProfile
    network: HostNetwork | None = None

    def __post_init__(self) -> None:
        if self.network is None:
            object.__setattr__(self, "network", HostNetwork(
                1, self.profile.inter_node_bandwidth))


@dataclasses.dataclass(frozen=True)
class DeviceClass:
    """Identical devices: one profile, hosts of `per_host` devices with one
    network.

    Attributes:
        profile / network / per_host: what the devices share.
        runs: their device indices, as sorted (first, end) runs.
        representative: the class's first device.
    """

    profile: DeviceProfile
    network: HostNetwork
    per_host: int
    runs: Runs
    representative: ClusterDevice

    @property
    def count(self) -> int:
        """Number of devices in the class."""
        return sum(end - first for first, end in self.runs)


def runs_count(runs: Runs) -> int:
    """Devices in `runs`."""
    return sum(end - first for first, end in runs)


def merge_runs(runs: Sequence[tuple[int, int]]) -> Runs:
    """Sorted runs with touching ones joined."""
    out: list[list[int]] = []
    for first, end in sorted(runs):
        if out and first <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([first, end])
    return tuple((a, b) for a, b in out)


def take_runs(runs: Runs, k: int) -> tuple[Runs, Runs]:
    """(the first `k` devices of `runs`, the rest)."""
    head: list[tuple[int, int]] = []
    tail: list[tuple[int, int]] = []
    for first, end in runs:
        if k <= 0:
            tail.append((first, end))
        elif end - first <= k:
            head.append((first, end))
            k -= end - first
        else:
            head.append((first, first + k))
            tail.append((first + k, end))
            k = 0
    return tuple(head), tuple(tail)


def runs_text(runs: Runs) -> str:
    """Runs written compactly: ((0, 3), (5, 6)) -> "0-2,5"."""
    return ",".join(f"{a}-{b - 1}" if b - a > 1 else str(a)
                    for a, b in merge_runs(runs))


class DeviceLayout(Sequence):
    """Every device of `hosts`, numbered host by host, made on demand.

    `layout[i]` is the ClusterDevice of index i; iterating makes them one
    by one; `classes` groups the devices without making any.
    """

    def __init__(self, hosts: Sequence[HostSpec]) -> None:
        self.hosts = tuple(hosts)
        self.offsets = [0]
        for host in self.hosts:
            self.offsets.append(self.offsets[-1] + host.devices)
        if not self.offsets[-1]:
            raise ClusterError("the cluster has no devices")
        self._classes: tuple[DeviceClass, ...] | None = None

    def __len__(self) -> int:
        return self.offsets[-1]

    def host_of(self, index: int) -> int:
        """The host of device `index`."""
        return bisect.bisect_right(self.offsets, index) - 1

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        h = self.host_of(index)
        host = self.hosts[h]
        return ClusterDevice(index, h, index - self.offsets[h], host.profile,
                             host.network)

    def __iter__(self) -> Iterator[ClusterDevice]:
        for h, host in enumerate(self.hosts):
            for local in range(host.devices):
                yield ClusterDevice(self.offsets[h] + local, h, local,
                                    host.profile, host.network)

    def host_runs(self, runs: Runs) -> Runs:
        """The hosts of the devices in `runs`, as runs of host indices."""
        out = []
        for first, end in runs:
            out.append((self.host_of(first), self.host_of(end - 1) + 1))
        return merge_runs(out)

    @property
    def classes(self) -> tuple[DeviceClass, ...]:
        """The devices grouped into DeviceClasses, in order of first device."""
        if self._classes is None:
            members: dict[tuple, list[tuple[int, int]]] = {}
            for h, host in enumerate(self.hosts):
                key = (host.profile, host.network, host.devices)
                members.setdefault(key, []).append(
                    (self.offsets[h], self.offsets[h + 1]))
            self._classes = tuple(
                DeviceClass(profile, network, per_host, merge_runs(runs),
                            self[runs[0][0]])
                for (profile, network, per_host), runs in members.items())
        return self._classes


def cluster_devices(hosts: Sequence[HostSpec]) -> list[ClusterDevice]:
    """Every device of `hosts`, numbered host by host (as a list)."""
    return list(DeviceLayout(hosts))


def layout_of(devices: Sequence[ClusterDevice]) -> DeviceLayout:
    """`devices` itself when it is a DeviceLayout, else the layout of the
    hosts they belong to (every device of each host, in host order)."""
    if isinstance(devices, DeviceLayout):
        return devices
    counts: dict[int, list[ClusterDevice]] = {}
    for device in devices:
        counts.setdefault(device.host, []).append(device)
    return DeviceLayout([HostSpec(members[0].profile, len(members),
                                  members[0].network)
                         for _, members in sorted(counts.items())])

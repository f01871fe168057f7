"""A model as the planner sees it: layers of numbers (no TensorFlow).

`LayerSpec` is one layer's (or TaskGraph's) per-example FLOPs, bytes and
activation bytes and its parameter bytes; `ModelSpec` is the model: its
layers in order, the compute dtype and what the figures leave out.  The
built-in models of ``epl-plan --model`` are written as these directly;
`epl.planner.graph_model.model_from_graph` derives them from a training
graph (and is the only part that needs TensorFlow).
"""
from __future__ import annotations

import dataclasses

from epl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer (or TaskGraph) of a model, as numbers.

    Per-example figures cover one training example's forward and backward
    pass.  "split" figures belong to the layer's split dimension (for
    example the experts of a mixture-of-experts layer), which is sharded
    over the devices: `split_parameter_bytes` is the whole dimension's
    parameters, `split_flops_per_example` what one example costs on
    whichever device owns its expert.

    Attributes:
        name: label for messages.
        flops_per_example: forward + backward FLOPs of the replicated part.
        bytes_per_example: memory traffic of the same.
        activation_bytes_per_example: bytes kept for the backward pass.
        parameter_bytes: replicated parameters.
        recompute_flops_per_example: forward FLOPs re-run under gradient
            checkpointing (None: a third of forward + backward).
        checkpointed_activation_bytes_per_example: activation bytes under
            checkpointing (None: computed over the model's layers with
            `cost_model.checkpointed_bytes`).
        split_parameter_bytes / split_flops_per_example /
        split_bytes_per_example / split_activation_bytes_per_example: the
            split part, as above.
        alltoall_bytes_per_example: bytes one example sends to other devices
            for its split part (dispatch + combine, forward + backward).
        stage: the annotated stage (TaskGraph index).
        op_counts: (op type, count) of the ops one replica of the layer
            runs per step (forward, backward and its optimizer update);
            each op costs its device's `DeviceProfile.op_overhead_s` (plus
            `op_type_overhead_s` for its type) on top of the roofline.
            Empty where unknown (the built-in analytic models).
    """

    name: str
    flops_per_example: float = 0.0
    bytes_per_example: float = 0.0
    activation_bytes_per_example: float = 0.0
    parameter_bytes: float = 0.0
    recompute_flops_per_example: float | None = None
    checkpointed_activation_bytes_per_example: float | None = None
    split_parameter_bytes: float = 0.0
    split_flops_per_example: float = 0.0
    split_bytes_per_example: float = 0.0
    split_activation_bytes_per_example: float = 0.0
    alltoall_bytes_per_example: float = 0.0
    stage: int = 0
    op_counts: tuple[tuple[str, int], ...] = ()

    @property
    def ops_per_step(self) -> int:
        """Ops one replica of the layer runs per step."""
        return sum(count for _, count in self.op_counts)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: layers of numbers.

    Attributes:
        name: label.
        layers: in model order.
        compute_dtype: the dtype whose peak FLOP/s applies ("float16" for
            mixed precision).
        parameter_dtype_bytes: bytes per parameter element (for the
            optimizer update's element count).
        split_units: size of the split dimension shared by all split layers
            (e.g. experts per layer); 0 when nothing is split.
        batch_size: the batch the description was measured at, if known.
        exact: False when some figure is an estimate (unknown shapes, op
            types the cost model does not know).
        notes: remarks explain() prints.
        optimizer: the optimizer the model was built with, if known (a
            graph's apply ops); plan_cluster uses it when given none.
        unknown_op_types: (op type, op count) of the op types the cost
            model has no formula for, most frequent first (a graph's).
        model_layers: the model's own layers, by name, in order (a graph's:
            the scopes of its trained variables, `graph_model`), for reports;
            `layers` are what the planner places (one per TaskGraph of a
            graph). Empty when the layers are the model's (the built-ins).
    """

    name: str
    layers: tuple[LayerSpec, ...]
    compute_dtype: str = "float32"
    parameter_dtype_bytes: int = 4
    split_units: int = 0
    batch_size: int | None = None
    exact: bool = True
    notes: tuple[str, ...] = ()
    optimizer: str | None = None
    unknown_op_types: tuple[tuple[str, int], ...] = ()
    model_layers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "model_layers", tuple(self.model_layers))
        if not self.layers:
            raise ConfigError(f"model {self.name!r} has no layers")
        if any(layer.split_parameter_bytes or layer.split_flops_per_example
               for layer in self.layers) and self.split_units < 1:
            raise ConfigError(f"model {self.name!r} has split layers but "
                              f"split_units={self.split_units}")

    @property
    def parameter_bytes(self) -> float:
        """Replicated plus split parameter bytes."""
        return sum(l.parameter_bytes + l.split_parameter_bytes
                   for l in self.layers)

    @property
    def num_parameters(self) -> float:
        """Parameter count."""
        return self.parameter_bytes / self.parameter_dtype_bytes

    @property
    def flops_per_example(self) -> float:
        """Forward + backward FLOPs of one example (replicated + split)."""
        return sum(l.flops_per_example + l.split_flops_per_example
                   for l in self.layers)

    @property
    def stages(self) -> int:
        """Number of distinct annotated stages."""
        return len({layer.stage for layer in self.layers})

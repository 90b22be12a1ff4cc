"""What crosses a stage boundary: ``ports.json`` read into ``Port``/``StagePorts``, the micro-batch
split, object values as JSON, and the model's output structure rebuilt from the last stage's sends.

Stages and ports. A stage is an ``nn.Module`` whose ``forward(*received)`` returns the tuple of
values it sends (the last stage: the model outputs). Its ports (``ports.json``) list what it
receives and sends; stage k's ``sends`` equal stage k+1's ``receives``, in order. The runtime
only talks to the neighbouring stage: a value that skips stages (a residual, token ids, a shape)
is relayed by every stage in between, which receives it and sends it on. Shapes in the spec are
for the full (compiled) batch of n samples; microbatch i gets ``n_i`` of them, the sizes of
``torch.tensor_split(range(n), m)`` (``split_sizes``), so every rank derives every buffer's shape
alone. A batch dim (``batch_dim``, usually 0) of ``c * n`` rows (``shape_expr`` like ``2*B`` or
``B*S``) gets ``c * n_i``; with unequal micro-batches (UMPIPE) ``n_i`` are the stage's own
chunk sizes instead (``microbatch_extents``); ``n`` is the extent of a dim whose ``shape_expr`` is ``B``, else that of
the first batched port. Stage 0 splits the model inputs so; ``batch_dim: null`` values go whole
to every microbatch.

JSON values (``to_json``/``from_json``): what an object port carries and how checkpoints store
optimizer state — JSON, not pickle, so a peer cannot make us run code. Values are
None/bool/int/float/str, torch.dtype, torch.device and lists, tuples, dicts of those (tuples and
int keys survive); checkpoints also hold tensors, stored beside the JSON.

The micro-batch split (``split_sizes``, ``split_batch``) and the output tree (``build_output``)
are shared with the one-process runtime, ``pipecc.runtime.local``. Imports ``pipecc.errors`` and
``pipecc.runtime.dtypes`` only, and torch where a function needs it (and, to rebuild a model's
own output class, that class's module): ``StagePorts.from_json(spec, dtype_name)`` parses a
``ports.json`` without torch, its dtypes by name, as `pipecc run`'s launcher checks a folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pipecc.errors import PipeccError
from pipecc.runtime.dtypes import torch_dtype

if TYPE_CHECKING:  # NOTE: torch where a function needs it: the launcher parses ports.json without it
    import torch

__all__ = [
    "Port",
    "StagePorts",
    "boundary_digest",
    "as_output_type",
    "as_tuple",
    "build_output",
    "describe",
    "flatten",
    "from_json",
    "microbatch_extents",
    "output_class",
    "output_ports",
    "split_batch",
    "split_sizes",
    "to_json",
    "unflatten",
]


# ---------------------------------------------------------------------------- ports


@dataclass(frozen=True)
class Port:
    """One value crossing a stage boundary, as ``ports.json`` describes it (the runtime's view;
    the compiler's ``backends.torch.stages.Port``, which writes ``ports.json``, is another class).

    ``kind`` is "tensor", "object" (JSON-able Python value) or "tuple" (``items`` are its
    elements, each a port; sent as its leaves). ``shape`` is at the compiled batch size;
    ``batch_dim`` is the dim that grows with the batch (its extent may be a multiple of it,
    e.g. B*S), or None when the value is the same for every microbatch.
    """

    name: str
    kind: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    requires_grad: bool = False
    batch_dim: int | None = None
    items: tuple[Port, ...] = ()
    batch_expr: str | None = None  # shape_expr[batch_dim] when the compiler wrote it
    # dims whose shape_expr names the folder's declared length symbol (``dynamic`` in the port's
    # dict, set by ``pipecc.runtime.lengths.mark_dynamic`` from pipecc.json's ``lengths``): their
    # extent changes from batch to batch, so messages carry the shape
    # (``pipecc.runtime.messages``); () = fixed
    dynamic: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, d: dict[str, Any], name: str | None = None,
                  dtype_of: Callable[[str], Any] = torch_dtype) -> Port:
        """The port ``d`` describes; ``dtype_of`` resolves its dtype's name (None: no dtype):
        ``torch.dtype``s, or ``pipecc.runtime.dtypes.dtype_name``'s names without torch."""
        name = str(d.get("name", name))
        kind = d.get("kind", "tensor")
        if kind == "tuple":
            return cls(name, kind, items=tuple(cls.from_json(item, f"{name}.{i}", dtype_of)
                                               for i, item in enumerate(d.get("items", ()))))
        if kind == "object":
            return cls(name, kind)
        if kind != "tensor":
            raise PipeccError(f"port {name!r}: kind must be 'tensor', 'object' or 'tuple', got {kind!r}")
        dtype = dtype_of(str(d.get("dtype", "float32")))
        if dtype is None:
            raise PipeccError(f"port {name!r}: unknown dtype {d.get('dtype')!r}")
        shape = tuple(int(n) for n in d.get("shape", ()))
        batch_dim = d.get("batch_dim")
        if batch_dim is not None and not 0 <= batch_dim < len(shape):
            raise PipeccError(f"port {name!r}: batch_dim {batch_dim} out of range for shape {list(shape)}")
        exprs = d.get("shape_expr")
        batch_expr = str(exprs[batch_dim]) if exprs and batch_dim is not None else None
        dynamic = tuple(int(i) for i in d.get("dynamic", ()))
        return cls(name, kind, shape, dtype, bool(d.get("requires_grad", False)), batch_dim, (), batch_expr,
                   dynamic)

    def leaves(self) -> list[Port]:
        return [leaf for item in self.items for leaf in item.leaves()] if self.kind == "tuple" else [self]

    @property
    def carries_grad(self) -> bool:
        """True when a gradient for this value travels back (both neighbours agree from the spec)."""
        return (self.kind == "tensor" and self.requires_grad and self.dtype is not None
                and (self.dtype.is_floating_point or self.dtype.is_complex))  # complex weights train too

    def extents(self, batch: int | None, m: int | Sequence[int]) -> list[int] | None:
        """The batch dim's extent in each microbatch, or None when the value is not batched."""
        if self.batch_dim is None:
            return None
        if batch is None:
            raise PipeccError(f"port {self.name!r} is batched but the stage's batch size is unknown")
        return microbatch_extents(self.shape[self.batch_dim], batch, m, self.name)

    def microbatch_shape(self, mb: int, batch: int | None, m: int | Sequence[int]) -> tuple[int, ...]:
        """The micro-batch's shape at the compiled lengths (a dynamic dim's actual extent comes
        with the message: ``matches``)."""
        extents = self.extents(batch, m)
        if extents is None:
            return self.shape
        return (*self.shape[:self.batch_dim], extents[mb], *self.shape[self.batch_dim + 1:])


    def matches(self, shape: Sequence[int], expected: Sequence[int]) -> bool:
        """``shape`` is ``expected`` but in the dynamic dims (any extent there)."""
        return len(shape) == len(expected) and all(
            a == b or i in self.dynamic for i, (a, b) in enumerate(zip(shape, expected)))


@dataclass(frozen=True)
class StagePorts:
    """A stage's ``ports.json``: what ``forward`` takes (``receives``) and returns (``sends``)."""

    receives: tuple[Port, ...]
    sends: tuple[Port, ...]

    @classmethod
    def from_json(cls, d: dict[str, Any], dtype_of: Callable[[str], Any] = torch_dtype) -> StagePorts:
        """``dtype_of``: as ``Port.from_json``'s (``pipecc.runtime.dtypes.dtype_name``: no torch)."""
        return cls(tuple(Port.from_json(p, f"in{i}", dtype_of) for i, p in enumerate(d.get("receives", ()))),
                   tuple(Port.from_json(p, f"out{i}", dtype_of) for i, p in enumerate(d.get("sends", ()))))

    @property
    def in_leaves(self) -> list[Port]:
        return [leaf for p in self.receives for leaf in p.leaves()]

    @property
    def out_leaves(self) -> list[Port]:
        return [leaf for p in self.sends for leaf in p.leaves()]

    @property
    def batch_size(self) -> int | None:
        """The compiled batch size: a batch dim whose expression is ``B`` if the compiler wrote
        expressions, else the first batched receive (or send); None when nothing is batched."""
        batched = [p for p in (*self.in_leaves, *self.out_leaves) if p.batch_dim is not None]
        for port in batched:
            if port.batch_expr == "B":
                return port.shape[port.batch_dim]
        return batched[0].shape[batched[0].batch_dim] if batched else None


def split_sizes(n: int, m: int, what: str = "batch") -> list[int]:
    """Microbatch sizes of ``torch.tensor_split(range(n), m)``: the first ``n % m`` get one more."""
    if n < m:
        raise PipeccError(f"{what}: batch of {n} cannot be split into {m} microbatches; use --microbatches <= {n}")
    return [n // m + (1 if i < n % m else 0) for i in range(m)]


def microbatch_extents(extent: int, batch: int, m: int | Sequence[int], what: str) -> list[int]:
    """Per-microbatch extents of a dim of ``extent = c * batch`` rows: ``c`` times each batch split.

    ``m`` is the micro-batch count (the equal split, ``split_sizes``) or a stage's own list of
    chunk sizes summing to ``batch`` (unequal micro-batches, ``pipecc.techniques.umpipe.runtime``)."""
    if extent % batch:
        raise PipeccError(f"port {what!r}: batch dim of {extent} is not a multiple of the batch size {batch}")
    sizes = split_sizes(batch, m, what) if isinstance(m, int) else list(m)
    if sum(sizes) != batch:
        raise PipeccError(f"port {what!r}: micro-batch sizes {sizes} do not sum to the batch of {batch}")
    return [extent // batch * n for n in sizes]


def split_batch(value: torch.Tensor, m: int, dim: int = 0) -> list[torch.Tensor]:
    """``value`` cut into ``m`` micro-batches along ``dim`` (``torch.tensor_split``): parts of
    ``split_sizes`` rows when there are at least ``m``, else some parts are empty."""
    import torch
    return list(torch.tensor_split(value, m, dim=dim))


def flatten(values: Sequence[Any], ports: Sequence[Port], what: str) -> list[Any]:
    """The leaf values of ``values`` (tuple ports opened), in wire order."""
    if len(values) != len(ports):
        raise PipeccError(f"{what}: {len(values)} values, ports.json declares {len(ports)}")
    leaves: list[Any] = []
    for v, port in zip(values, ports):
        if port.kind == "tuple":
            if not isinstance(v, (tuple, list)):
                raise PipeccError(f"{what}: {port.name!r} should be a tuple, got {type(v).__name__}")
            leaves += flatten(v, port.items, what)
        else:
            leaves.append(v)
    return leaves


def unflatten(leaves: Sequence[Any], ports: Sequence[Port]) -> list[Any]:
    """``flatten``'s inverse: tuple ports become tuples again."""
    it = iter(leaves)
    return [_built(p, it) for p in ports]


def _built(port: Port, it: Iterator[Any]) -> Any:
    # NOTE: a module-level function, not a closure calling itself: that closure would be a
    # reference cycle holding ``it``, so a micro-batch's received tensors stayed alive until the
    # garbage collector ran (measured: one extra micro-batch's input on a 1F1B last stage)
    return tuple(_built(item, it) for item in port.items) if port.kind == "tuple" else next(it)


def as_tuple(value: Any) -> tuple:
    """A stage's (or model's) return value as a tuple: a tuple or list as is, else one value."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def describe(port: Port) -> str:
    """``object`` or dtype and shape, e.g. ``float32[8, 16]`` (error messages, the handshake digest)."""
    return "object" if port.kind == "object" else f"{str(port.dtype).removeprefix('torch.')}{list(port.shape)}"


def boundary_digest(leaves: Sequence[Port]) -> bytes:
    """32 bytes identifying a boundary: names, kinds, shapes, dtypes, gradient flags, batch dims
    (the same for torch dtypes and `pipecc.runtime.dtypes` names; `wire.fingerprint` sends it)."""
    text = json.dumps([(p.name, describe(p), p.requires_grad, p.batch_dim) for p in leaves])
    return hashlib.sha256(text.encode()).digest()


# ---------------------------------------------------------------------------- JSON values


def to_json(value: Any, tensors: dict[str, torch.Tensor] | None = None, path: str = "") -> Any:
    """A JSON-able form of ``value`` that ``from_json`` inverts, tuples and int keys included.

    Tensors are moved into ``tensors`` under ``path`` and replaced by ``{"__tensor__": path}``;
    without ``tensors`` a tensor is an error (object ports carry no tensors).
    """
    import torch
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise PipeccError(f"{path or 'value'}: a tensor inside an object port; declare it as a tensor port")
        tensors[path] = value.detach().cpu().clone(memory_format=torch.contiguous_format)
        return {"__tensor__": path}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, torch.Size)):
        return {"__tuple__": [to_json(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_json(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: to_json(v, tensors, f"{path}.{k}") for k, v in value.items()}
        return {"__items__": [[to_json(k), to_json(v, tensors, f"{path}.{k}")] for k, v in value.items()]}
    raise PipeccError(f"{path or 'value'}: {type(value).__name__} is not JSON-able (allowed: None, bool, int, "
                      "float, str, torch.device, torch.dtype and lists, tuples, dicts of them)")


def from_json(value: Any, tensors: dict[str, torch.Tensor] | None = None, device: torch.device | None = None) -> Any:
    """``to_json``'s inverse; a ``torch.device`` becomes ``device`` when given (the receiver's own)."""
    import torch
    if isinstance(value, list):
        return [from_json(v, tensors, device) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            assert tensors is not None
            return tensors[value["__tensor__"]]
        if "__device__" in value:
            return device or torch.device(value["__device__"])
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__tuple__" in value:
            return tuple(from_json(v, tensors, device) for v in value["__tuple__"])
        if "__items__" in value:
            return {from_json(k): from_json(v, tensors, device) for k, v in value["__items__"]}
        return {k: from_json(v, tensors, device) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- the model's outputs


def build_output(tree: dict[str, Any] | None, env: dict[str, Any]) -> Any:
    """The model's output structure from its JSON tree (``model_output``, written by
    ``backends.torch.stages.output_tree``) and the port values; no tree: the one value, or a tuple."""
    if tree is None:
        return next(iter(env.values())) if len(env) == 1 else tuple(env.values())
    if "port" in tree:
        return env[tree["port"]]
    if "tuple" in tree:
        return as_output_type(output_class(tree.get("type")), tuple(build_output(t, env) for t in tree["tuple"]))
    if "list" in tree:
        return [build_output(t, env) for t in tree["list"]]
    if "dict" in tree:
        return as_output_type(output_class(tree.get("type")),
                              {k: build_output(t, env) for k, t in tree["dict"]})
    return tree.get("const")


def output_class(name: str | None) -> type | None:
    """The class a tree's ``type`` names (``module:qualname``: a Hugging Face ModelOutput, a
    namedtuple), or None where there is none or it cannot be found in this process.

    NOTE: the module is imported when it is not yet (a compiled folder is code already: its
    stage files run when loaded, see ``pipecc.runtime.trust``); a class of a model file that
    ``pipecc run`` imported under another name is not found, and its output stays a plain
    dict or tuple."""
    if not name or ":" not in name:
        return None
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001  # not importable here: the plain structure
            return None
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, (tuple, dict)) else None


def as_output_type(cls: type | None, value: tuple | dict) -> Any:
    """`value` (a tuple or dict) as an instance of `cls`, as the model returns it; `value` itself
    when there is no class or it will not take the items."""
    if cls is None or isinstance(value, cls) or not issubclass(cls, type(value)):
        return value
    try:
        if isinstance(value, dict):
            return cls(**value) if dataclasses.is_dataclass(cls) else cls(value)
        return cls(*value) if hasattr(cls, "_fields") else cls(value)
    except Exception:  # noqa: BLE001  # a constructor we cannot call so: the plain structure
        return value


def output_ports(tree: dict[str, Any] | None, value: Any, found: dict[str, Any]) -> dict[str, Any]:
    """``build_output``'s inverse: port name -> the part of the model output ``value`` it holds."""
    if tree is None or "port" in tree:
        found.setdefault(tree["port"] if tree else "output", value)
    elif "tuple" in tree or "list" in tree:
        for t, v in zip(tree.get("tuple", tree.get("list", ())), value):
            output_ports(t, v, found)
    elif "dict" in tree:
        for k, t in tree["dict"]:
            output_ports(t, value[k], found)
    return found

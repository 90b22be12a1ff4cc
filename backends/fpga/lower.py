"""Lowering: an fx stage graph (with pipecc meta) -> layer descriptors with their numbers.

    stage GraphModule ─► pipecc.targets.fpga_model.plan_layers (structure, shared with the planner)
                      ─► weights (BatchNorm folded into the conv/linear before it)
                      ─► golden activations from torch (ranges, fixed-point error bound)

Preconditions: the stage has one tensor input and one tensor output, dim 0 is the batch, and
the model is in eval mode (BatchNorm uses running statistics). Unsupported nodes raise
`UnsupportedOpError` before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F

from pipecc.backends.names import Identifiers
from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME
from pipecc.ir.train_flag import resolve
from pipecc.targets.fpga_model import LayerSpec, NumberFormat, UnsupportedOpError, plan_layers

GELU_LIPSCHITZ = 1.13  # max |gelu'(x)| = 1.1289 (erf and tanh forms)
GELU_INTERP_ERR = 2e-5  # max|gelu''| * h^2 / 8 with h = 1/64 (table in pipecc_layers.h)


@dataclass
class Layer:
    """One process: its structure, a C identifier, and the numbers it needs."""

    spec: LayerSpec
    ident: str                      # unique C identifier (see `c_identifiers`), never the raw name
    label: str                      # the human name made safe for a // comment
    sources: tuple[str, ...]        # human names of the nodes folded into it, comment-safe
    weights: dict[str, np.ndarray]  # "w" (MH, MW) or (C,), "b" (MH,) or (C,)
    in_absmax: float                # largest |input| in the golden run
    out_absmax: float
    in_l1max: float = 0.0           # MAC layers: largest sum |x| over one output's fan-in
    in_l2max: float = 0.0           # MAC layers: largest sum x^2 over one output's fan-in


@dataclass
class LoweredStage:
    layers: list[Layer]
    example_input: torch.Tensor     # (B, *in_shape) float32
    golden_output: torch.Tensor     # (B, *out_shape) float32, torch at the stage boundary


def c_identifiers(specs: list[LayerSpec]) -> list[str]:
    """One C identifier per layer, from its human name by the rule of `pipecc.backends.names`
    (`blocks.0.mlp.fc` -> `blocks_0_mlp_fc`, `4` -> `dense_4`: a digit-only name is led by the
    layer kind). The code only ever writes it with a role prefix (`s_`, `config_`, `w_`, `b_`)
    or as a process label, so no C keyword can clash; a clone's outputs are `s_<ident>_<k>`,
    names kept free of every other layer's."""
    scope = Identifiers()
    return [scope.fresh(s.name, s.kind, [f"_{k}" for k in range(s.attrs.get("copies", 0))])
            for s in specs]


def comment_safe(text: str) -> str:
    """Printable ASCII without comment terminators or line continuations."""
    text = "".join(c if 32 <= ord(c) < 127 else "?" for c in text)
    return text.replace("*/", "*_/").replace("/*", "/_*").replace("\\", "/")[:80]


def _tensor(gm: fx.GraphModule, path: str | None) -> torch.Tensor | None:
    if path is None:
        return None
    obj: Any = gm
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj.detach().to(torch.float64)


def _weights(gm: fx.GraphModule, spec: LayerSpec) -> dict[str, np.ndarray]:
    p = {role: _tensor(gm, path) for role, path in spec.params.items()}
    if spec.kind in ("dense", "conv2d"):
        w = p["weight"].reshape(p["weight"].shape[0], -1)
        b = p.get("bias") if p.get("bias") is not None else torch.zeros(w.shape[0], dtype=torch.float64)
        if "bn_running_mean" in p:  # y = (Wx + b - mean) * gamma / sqrt(var + eps) + beta
            s, t = _affine(p, "bn_", spec.attrs["bn_eps"])
            w, b = w * s[:, None], b * s + t
        return {"w": w.numpy(), "b": b.numpy()}
    if spec.kind == "scale":
        s, t = _affine(p, "", spec.attrs["eps"])
        return {"w": s.numpy(), "b": t.numpy()}
    return {}


def _affine(p: dict[str, torch.Tensor | None], pre: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    mean, var = p[pre + "running_mean"], p[pre + "running_var"]
    gamma = p.get(pre + "weight") if p.get(pre + "weight") is not None else torch.ones_like(mean)
    beta = p.get(pre + "bias") if p.get(pre + "bias") is not None else torch.zeros_like(mean)
    s = gamma / torch.sqrt(var + eps)
    return s, beta - mean * s


class _Recorder(fx.Interpreter):
    """Runs the stage and keeps every node's output (golden activations)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple, dict]:
        """Constants per train/eval mode (`pipecc.ir.train_flag`) at their eval value: an FPGA
        stage computes inference."""
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return resolve(args, False), resolve(kwargs, False)


def _fan_in_max(spec: LayerSpec, x: torch.Tensor, power: int) -> float:
    """Largest sum |x|^power over the inputs of one output (one window of a conv)."""
    a = spec.attrs
    x = x.detach().abs().to(torch.float64) ** power
    if spec.kind == "dense":
        return float(x.sum(-1).max())
    ones = torch.ones(a["groups"], a["in_c"] // a["groups"], *a["kernel"], dtype=torch.float64)
    return float(F.conv2d(x, ones, stride=a["stride"], padding=a["pad"], groups=a["groups"]).max())


def lower(gm: fx.GraphModule, example_input: torch.Tensor) -> LoweredStage:
    """Layers with weights and golden ranges for a one-input, one-output stage."""
    specs = plan_layers(gm)
    ends = [s for s in specs if s.kind in ("unpack", "pack")]
    if [s.kind for s in ends] != ["unpack", "pack"]:
        raise PipeccError(f"an FPGA stage needs one tensor input and one tensor output; this "
                          f"one has {len(ends) - 1 if ends else 0} ports besides the first")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise UnsupportedOpError("placeholder", placeholders[-1].name if placeholders else "-",
                                 "an FPGA stage takes exactly one input")
    rec = _Recorder(gm)
    with torch.no_grad():
        out = rec.run(example_input.to(torch.float32))
    out = out[0] if isinstance(out, (tuple, list)) else out
    human = {n.name: str(n.meta.get(META_NAME, n.name)) for n in gm.graph.nodes}
    layers: list[Layer] = []
    for spec, ident in zip(specs, c_identifiers(specs)):
        src = rec.values.get(spec.inputs[0]) if spec.inputs else example_input
        dst = rec.values.get(spec.tensor) if spec.tensor else out
        layer = Layer(spec, ident, comment_safe(spec.name),
                      tuple(comment_safe(human.get(n, n)) for n in spec.nodes),
                      _weights(gm, spec), float(src.abs().max()), float(dst.abs().max()))
        if spec.kind in ("dense", "conv2d"):
            layer.in_l1max, layer.in_l2max = _fan_in_max(spec, src, 1), _fan_in_max(spec, src, 2)
        layers.append(layer)
    return LoweredStage(layers, example_input.detach().to(torch.float32).contiguous(),
                        out.detach().to(torch.float32).contiguous())


def error_bound(layers: list[Layer], fmt: NumberFormat) -> float:
    """Worst-case |C-sim - torch| at the stage output in fixed point (0 for float).

    Propagated layer by layer with half-LSB rounding (AP_RND_CONV) everywhere:
      MAC   e' = L·e + (l1 + fan_in·e)·q + q         L = max row sum |w|, l1 = max sum |x|
                                                      (weight rounding), bias + output rounding
      scale e' = max|s|·e + (|x|max + e)·q + 2q
      gelu  e' = 1.13·e + 2q + 2e-5 (table);  avg pools e' = e + 2q;  add e' = e_a + e_b
      relu, relu6, max pool, concat, clone: e' = e;  input rounding: e = q
    with q = LSB/2. Valid while no value saturates (`saturation` reports those).
    """
    if fmt.is_float:
        return 0.0
    q = fmt.lsb / 2
    err: dict[str, float] = {}
    for layer in layers:
        s = layer.spec
        e = max((err.get(t, 0.0) for t in s.inputs), default=0.0)
        if s.kind == "unpack":
            e = q
        elif s.kind in ("dense", "conv2d"):
            w = layer.weights["w"]
            e = float(np.abs(w).sum(1).max()) * e + (layer.in_l1max + w.shape[1] * e) * q + 2 * q
        elif s.kind == "scale":
            e = float(np.abs(layer.weights["w"]).max()) * e + (layer.in_absmax + e) * q + 2 * q
        elif s.kind == "gelu":
            e = GELU_LIPSCHITZ * e + 2 * q + GELU_INTERP_ERR
        elif s.kind in ("avgpool2d", "adaptive_avgpool2d"):
            e = e + 2 * q
        elif s.kind == "add":
            e = sum(err.get(t, 0.0) for t in s.inputs)
        if s.tensor:
            err[s.tensor] = e
        else:
            return e
    return 0.0


def saturation(layers: list[Layer], fmt: NumberFormat) -> list[str]:
    """Tensors or weights whose golden values exceed the fixed-point range (would clip)."""
    out = []
    for layer in layers:
        worst = max([layer.out_absmax] + [float(np.abs(v).max()) for v in layer.weights.values()
                                          if v.size])
        if worst > fmt.max_value:
            out.append(f"{layer.label}: |value| up to {worst:.4g} > {fmt.text} max {fmt.max_value:.4g}")
    return out


def error_sigma(layers: list[Layer], fmt: NumberFormat) -> float:
    """Statistical size (one standard deviation) of the fixed-point error at the output.

    Each rounding is an independent error uniform in +-LSB/2 (variance LSB^2/12, AP_RND_CONV is
    unbiased), propagated with the largest row sum of w^2 (MAC) and the largest fan-in sum of
    x^2 (weight rounding); added branches are treated as fully correlated. The largest error
    over a few thousand outputs is typically ~3-4 sigma; this is an estimate, not a bound.
    """
    if fmt.is_float:
        return 0.0
    v = fmt.lsb ** 2 / 12
    var: dict[str, float] = {}
    for layer in layers:
        s = layer.spec
        e = max((var.get(t, 0.0) for t in s.inputs), default=0.0)
        if s.kind == "unpack":
            e = v
        elif s.kind in ("dense", "conv2d"):
            w = layer.weights["w"]
            e = float((w ** 2).sum(1).max()) * e + layer.in_l2max * v + 2 * v
        elif s.kind == "scale":
            e = float((layer.weights["w"] ** 2).max()) * e + layer.in_absmax ** 2 * v + 2 * v
        elif s.kind == "gelu":
            e = GELU_LIPSCHITZ ** 2 * e + 2 * v + GELU_INTERP_ERR ** 2
        elif s.kind in ("avgpool2d", "adaptive_avgpool2d"):
            e = e + 2 * v
        elif s.kind == "add":
            e = sum(var.get(t, 0.0) ** 0.5 for t in s.inputs) ** 2
        if s.tensor:
            var[s.tensor] = e
        else:
            return e ** 0.5
    return 0.0

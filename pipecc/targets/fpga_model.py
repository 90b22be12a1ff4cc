"""Analytic FPGA cost model: what an FPGA stage costs (DSP, BRAM18, LUT, cycles, seconds).

One model for the planner and for the FPGA backend, so plan and `estimates.json` never disagree
(`passes/` may import this module; it imports nothing from `backends/`). Which nodes an FPGA can
hold, and as which processes, is `pipecc.targets.fpga_layers` (re-exported here).

    stage nodes ─► plan_layers (structure: one LayerSpec per dataflow process of the generated
                   top: unpack, layers with BatchNorm folded, clones for fan-out, pack)
                ─► choose_folding (parallelism per MAC layer to fit the card)
                ─► layer_estimates / stage_estimate / stage_time_s

Per layer, for the design backends/fpga generates (every process buffers one input frame):
  MAC layers (dense, conv2d), FINN MVAU folding with PE | MH, SIMD | MW:
      MH = output channels, MW = fan-in, vectors = output pixels (dense: leading dims)
      reuse_factor = (MH/PE)·(MW/SIMD)          (hls4ml: DSP lanes = n_in·n_out / reuse_factor)
      compute cycles = vectors·(MH/PE)·((MW/SIMD)·II_mac + depth)
      DSP = ceil(PE·SIMD / macs_per_dsp[dtype])  (catalog: fp32 0.2, fixed16 1, int8 2)
  BRAM18 per memory of `bits` split into `banks`: 0 when a bank holds <= 1 Kbit (LUTRAM),
      else banks·max(ceil(bank_bits / 18 Kbit), ceil(width / 36)).
  cycles (interval == latency for frame-buffered processes) = read + compute + write.
Stage: interval = max layer cycles, latency = longest path; time for `batch` samples =
(latency + (batch-1)·interval) / f_clk (+ link time when a link bandwidth is given).
LUT figures are rough (constants below are assumptions, not tool reports).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch.fx as fx

from pipecc.errors import PipeccError
from pipecc.targets.fpga_layers import (SUPPORTED_KINDS, LayerSpec, UnsupportedOpError, plan_layers,
                                supported)

__all__ = ["SUPPORTED_KINDS", "LayerSpec", "UnsupportedOpError", "plan_layers", "supported",
           "NumberFormat", "parse_number", "layer_estimate", "layer_estimates", "choose_folding",
           "stage_estimate", "stage_time_s", "unit_cycles", "mvau_dims"]

LINK_BITS = 512            # AXI-stream beat width of the stage ports
FLOAT_MAC_II = 4           # assumption: fp32 accumulate carries the fadd latency (~4 cycles)
PIPE_DEPTH = {True: 12, False: 4}   # assumption: MAC pipeline depth, float / fixed
LUT_PER_LANE = {True: 400, False: 40}  # assumption: LUTs per MAC lane beside its DSPs
LUT_PER_LAYER = 300        # assumption: control, address generation


@dataclass(frozen=True)
class NumberFormat:
    """`float` (fp32) or `ap_fixed<W,I>` (always AP_RND_CONV, AP_SAT: no silent wrap-around)."""

    text: str
    bits: int
    int_bits: int | None  # None for floating point

    @property
    def is_float(self) -> bool:
        return self.int_bits is None

    @property
    def lsb(self) -> float:
        return 0.0 if self.is_float else 2.0 ** -(self.bits - self.int_bits)

    @property
    def max_value(self) -> float:
        return math.inf if self.is_float else 2.0 ** (self.int_bits - 1) - self.lsb

    @property
    def dtype(self) -> str:
        """Catalog dtype for macs_per_dsp: fp32 / fp16 / int8 / fixed16 (wider: 2 DSPs)."""
        if self.is_float:
            return "fp32" if self.bits == 32 else "fp16"
        return "int8" if self.bits <= 8 else "fixed16"

    def macs_per_dsp(self, card_fpga: Mapping[str, Any]) -> float:
        mpd = float(card_fpga["macs_per_dsp"][self.dtype])
        # NOTE: DSP48E2 multiplies 27x18; two operands wider than 18 bits need two slices.
        return mpd / 2 if not self.is_float and self.bits > 18 else mpd


_FIXED = re.compile(r"^\s*ap_fixed\s*<\s*(\d+)\s*,\s*(-?\d+)\s*>\s*$")
# NOTE: tf32 / bf16 have no FPGA operator; like the catalog, compute them in fp32.
_ALIASES = {"float": (32, None), "fp32": (32, None), "float32": (32, None), "tf32": (32, None),
            "bf16": (32, None), "fp16": (16, None), "fixed16": (16, 6), "int8": (8, 4)}


def parse_number(text: str | NumberFormat) -> NumberFormat:
    """`float`, `ap_fixed<16,6>`, or a planner dtype (`fp32`, `fixed16`, `int8`)."""
    if isinstance(text, NumberFormat):
        return text
    key = str(text).strip().lower().removeprefix("torch.")
    if key in _ALIASES:
        bits, ib = _ALIASES[key]
        return NumberFormat("float" if ib is None and bits == 32 else
                            ("half" if ib is None else f"ap_fixed<{bits},{ib}>"), bits, ib)
    m = _FIXED.match(str(text))
    if not m or not (2 <= int(m[1]) <= 64 and 1 <= int(m[2]) <= int(m[1])):
        raise PipeccError(f"number format {text!r}: use 'float' or 'ap_fixed<W,I>' "
                          "with 2 <= W <= 64 and 1 <= I <= W")
    return NumberFormat(f"ap_fixed<{m[1]},{m[2]}>", int(m[1]), int(m[2]))


# ----------------------------------------------------------------------------- estimates
MAC_KINDS = ("dense", "conv2d")


def mvau_dims(spec: LayerSpec) -> tuple[int, int, int]:
    """(MH, MW, vectors) of a MAC layer: output channels, fan-in, output vectors."""
    a = spec.attrs
    if spec.kind == "dense":
        return a["n_out"], a["n_in"], a["n_vec"]
    return a["out_c"], a["in_c"] // a["groups"] * a["kernel"][0] * a["kernel"][1], \
        a["out_h"] * a["out_w"]


def _bram(total_bits: int, banks: int, width: int) -> tuple[int, int]:
    """(BRAM18, LUTRAM LUTs) of a memory of `total_bits` split into `banks` of `width` bits."""
    per = math.ceil(total_bits / max(banks, 1))
    if per == 0:
        return 0, 0
    if per <= 1024:
        return 0, math.ceil(per * banks / 64)
    return banks * max(math.ceil(per / 18432), math.ceil(width / 36)), 0


def layer_estimate(spec: LayerSpec, fmt: NumberFormat, card_fpga: Mapping[str, Any],
                   pe: int = 1, simd: int = 1) -> dict[str, Any]:
    """DSP, BRAM18, LUT, interval and latency cycles of one process at a given folding."""
    bits, flt, mpd = fmt.bits, fmt.is_float, fmt.macs_per_dsp(card_fpga)
    depth = PIPE_DEPTH[flt]
    n_in, n_out, a = spec.numel_in, spec.numel_out, spec.attrs
    dsp, lut, macs, rf = 0, LUT_PER_LAYER, 0, 1
    mems: list[tuple[int, int]] = []
    if spec.kind in MAC_KINDS:
        mh, mw, vec = mvau_dims(spec)
        rf, macs = (mh // pe) * (mw // simd), vec * mh * mw
        cycles = n_in + vec * (mh // pe) * ((mw // simd) * (FLOAT_MAC_II if flt else 1) + depth) + n_out
        dsp, lut = math.ceil(pe * simd / mpd), lut + pe * simd * LUT_PER_LANE[flt]
        mems = [_bram(mh * mw * bits, pe * simd, bits), _bram(n_in * bits, simd, bits),
                _bram(n_out * bits, pe, bits), _bram(mh * bits, pe, bits)]
    elif spec.kind in ("maxpool2d", "avgpool2d", "adaptive_avgpool2d"):
        window = n_out * (a["bin_h"] * a["bin_w"] if spec.kind.startswith("adaptive")
                          else a["kernel"][0] * a["kernel"][1])
        cycles = n_in + window + depth
        dsp = 2 if flt and spec.kind != "maxpool2d" else 0   # fp32 fadd 'full_dsp'
        mems = [_bram(n_in * bits, 1, bits)]
    elif spec.kind == "clone":
        cycles = n_in + 2
        mems = [_bram(n_in * bits, 1, bits)] * a["copies"]   # FIFOs deep enough for a frame
    else:  # streaming element-wise processes
        cycles = n_out + depth
        if spec.kind == "scale":
            dsp, macs = math.ceil(1 / mpd), n_out
            mems = [_bram(2 * a["channels"] * bits, 1, bits)]
        elif spec.kind == "add":
            dsp = 2 if flt else 0
        elif spec.kind == "gelu":  # float: erf + 3 fmul + fadd; fixed: table + interpolation
            dsp = 20 if flt else math.ceil(1 / mpd)
            mems = [] if flt else [_bram(1025 * bits, 1, bits)]
        elif spec.kind in ("pack", "unpack"):
            lut += LINK_BITS
    bram = sum(m[0] for m in mems)
    lut += sum(m[1] for m in mems) + (0 if spec.kind in MAC_KINDS else 2 * bits)
    return {"name": spec.name, "kind": spec.kind, "nodes": list(spec.nodes), "pe": pe,
            "simd": simd, "reuse_factor": rf, "macs": macs, "dsp": dsp, "bram18": bram,
            "lut": lut, "ii_cycles": cycles, "latency_cycles": cycles}


def _card(card: Any) -> Any:
    from pipecc.targets.catalog import load_catalog
    dev = load_catalog().device(str(card).lower()) if isinstance(card, str) else card
    if dev.kind != "fpga" or not dev.fpga:
        raise PipeccError(f"device '{dev.name}' is not an FPGA card")
    return dev


def _next_fold(spec: LayerSpec, pe: int, simd: int) -> tuple[int, int] | None:
    mh, mw, _ = mvau_dims(spec)
    up = [d for d in range(simd + 1, mw + 1) if mw % d == 0]
    if up:
        return pe, up[0]
    up = [d for d in range(pe + 1, mh + 1) if mh % d == 0]
    return (up[0], simd) if up else None


def choose_folding(layers: Sequence[LayerSpec], card: Any, number: Any) -> list[tuple[int, int]]:
    """(PE, SIMD) per layer: raise the parallelism of the slowest MAC layer (SIMD first, then
    PE, divisors only) while the stage stays within `efficiency.matmul` (FINN: 80%) of the
    card's DSP and BRAM18; stop when the slowest process cannot be sped up."""
    dev, fmt = _card(card), parse_number(number)
    limit = dev.efficiency["matmul"]
    fold = [(1, 1)] * len(layers)
    est = [layer_estimate(s, fmt, dev.fpga) for s in layers]
    dsp, bram = sum(e["dsp"] for e in est), sum(e["bram18"] for e in est)
    while est:
        i = max(range(len(est)), key=lambda j: est[j]["ii_cycles"])
        s = layers[i]
        # NOTE: once compute is below the frame's read+write cycles, lanes buy < 2x: stop.
        io_bound = est[i]["ii_cycles"] <= 2 * (s.numel_in + s.numel_out)
        nxt = _next_fold(s, *fold[i]) if s.kind in MAC_KINDS and not io_bound else None
        if nxt is None:
            break
        new = layer_estimate(layers[i], fmt, dev.fpga, *nxt)
        d2, b2 = dsp - est[i]["dsp"] + new["dsp"], bram - est[i]["bram18"] + new["bram18"]
        if d2 > limit * dev.fpga["dsp"] or (b2 > bram and b2 > limit * dev.fpga["bram18"]):
            break
        fold[i], est[i], dsp, bram = nxt, new, d2, b2
    return fold


def layer_estimates(layers: Sequence[LayerSpec], card: Any, number: Any = "float",
                    folding: Sequence[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """Per-process estimates at `folding` (default: choose_folding for this card)."""
    dev, fmt = _card(card), parse_number(number)
    folding = folding or choose_folding(layers, dev, fmt)
    return [layer_estimate(s, fmt, dev.fpga, *f) for s, f in zip(layers, folding)]


def stage_estimate(layers: Sequence[LayerSpec], card: Any, number: Any = "float") -> dict:
    """What estimates.json holds: per-layer figures, stage totals against the card."""
    dev, fmt = _card(card), parse_number(number)
    est = layer_estimates(layers, dev, fmt)
    finish: dict[str, int] = {}
    latency = 0
    for s, e in zip(layers, est):
        end = max((finish.get(t, 0) for t in s.inputs), default=0) + e["latency_cycles"]
        finish[s.tensor] = end
        latency = max(latency, end)
    total = {k: sum(e[k] for e in est) for k in ("dsp", "bram18", "lut")}
    cap = {"dsp": dev.fpga["dsp"], "bram18": dev.fpga["bram18"], "uram": dev.fpga.get("uram"),
           "lut": dev.fpga.get("lut"), "utilisation_limit": dev.efficiency["matmul"]}
    interval = max((e["ii_cycles"] for e in est), default=0)
    clock = float(dev.fpga["clock_hz"])
    return {"source": "analytic", "card": dev.name, "part": dev.fpga.get("part"),
            "clock_hz": clock, "number": fmt.text, "dtype": fmt.dtype, "link_bits": LINK_BITS,
            "layers": est, "total": total, "capacity": cap,
            "utilisation": {k: total[k] / cap[k] for k in ("dsp", "bram18")},
            "fits": total["dsp"] <= cap["dsp"] and total["bram18"] <= cap["bram18"],
            "interval_cycles": interval, "latency_cycles": latency,
            "interval_s": interval / clock, "latency_s": latency / clock,
            "samples_per_s": clock / interval if interval else math.inf}


def _as_layers(stage: Any, gm: fx.GraphModule | None, point: Any) -> list[LayerSpec]:
    if isinstance(stage, fx.GraphModule):
        return plan_layers(stage, point=point)
    stage = list(stage)
    if stage and isinstance(stage[0], fx.Node):
        return plan_layers(gm or stage[0].graph.owning_module, stage, point)
    return stage


def stage_time_s(stage: Any, card: Any, number: Any = "float", batch: int = 1, *,
                 gm: fx.GraphModule | None = None, point: Mapping[Any, int] | None = None,
                 link_bandwidth: float | None = None) -> float:
    """Seconds for `batch` samples through one FPGA stage.

    How the planner should call it: for a candidate FPGA stage pass its fx nodes (in graph
    order) with the AnnotatedGraph's `gm` and `point`, the card name or `Device`, and the plan's
    dtype (`fp32` -> float, `fixed16` -> ap_fixed<16,6>, `int8`); check `supported(node)` (or
    `SUPPORTED_KINDS` for a quick kind filter) first — an unsupported node raises
    UnsupportedOpError. The FPGA is a dataflow pipeline, so stage time is NOT a sum of node
    times: (latency + (batch-1)·interval) / f_clk. Leave `link_bandwidth` None when the planner
    models inter-stage links itself; given (bytes/s) it adds the packed beats in and out.
    """
    layers = _as_layers(stage, gm, point)
    est = stage_estimate(layers, card, number)
    t = (est["latency_cycles"] + (batch - 1) * est["interval_cycles"]) / est["clock_hz"]
    if link_bandwidth:
        bits = parse_number(number).bits
        beats = sum(-(-s.numel_out * bits // LINK_BITS) for s in layers if s.kind == "unpack") + \
            sum(-(-s.numel_in * bits // LINK_BITS) for s in layers if s.kind == "pack")
        t += batch * beats * LINK_BITS / 8 / link_bandwidth
    return t


def unit_cycles(nodes: Sequence[fx.Node], card: Any, number: Any = "float", *,
                gm: fx.GraphModule | None = None,
                point: Mapping[Any, int] | None = None) -> tuple[float, ...]:
    """(latency, interval, floor, clock_hz, bram18) of `nodes` for planners that sum unit
    costs.

    latency and interval are the cycles per sample of the nodes' own processes when they are
    a stage of their own, without that stage's link unpack/pack (a real stage has one pair,
    not one per unit): Σ over a stage's units of (latency + (b-1)·interval) / f_clk
    approximates stage_time_s, exactly where the stage's MAC layers share the DSP budget
    in proportion to their work. The stage's real time is stage_time_s; planners re-cost
    the stages they choose with it. floor is the MAC cycles per sample at the card's whole
    usable MAC budget (`efficiency.matmul` of its DSPs), a lower bound on what the nodes add
    to any stage's interval, so Σ b·floor / f_clk ≤ stage_time_s for every stage. bram18 is
    what the processes hold at the least parallel folding (PE = SIMD = 1): additive, and
    choose_folding never raises a stage's BRAM above that sum or its utilisation limit.
    Raises UnsupportedOpError for nodes the FPGA backend cannot generate.
    """
    dev, fmt = _card(card), parse_number(number)
    layers = _as_layers(list(nodes), gm, point)
    est = layer_estimates(layers, dev, fmt)
    own = [e for e in est if e["kind"] not in ("pack", "unpack")]
    lanes = dev.efficiency["matmul"] * dev.fpga["dsp"] * fmt.macs_per_dsp(dev.fpga)
    ii = FLOAT_MAC_II if fmt.is_float else 1
    floor = sum(e["macs"] for e in own if e["kind"] in MAC_KINDS) * ii / lanes
    least = sum(layer_estimate(s, fmt, dev.fpga)["bram18"] for s in layers
                if s.kind not in ("pack", "unpack"))
    return (float(sum(e["latency_cycles"] for e in own)),
            float(sum(e["ii_cycles"] for e in own)), float(floor), float(dev.fpga["clock_hz"]),
            float(least))

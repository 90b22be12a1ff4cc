"""The writer: lowered layers -> the HLS project of one pipeline stage (layout of FPGA.md).

    stage_<i>/firmware/<top>.cpp .h defines.h parameters.h pipecc_layers.h pack.h
             firmware/weights/w_*.h (synthesis) + w_*.bin (C simulation)
             csim_include/hls_stream.h (g++ only)   tb/<top>_tb.cpp <top>_bridge.cpp
             tb_data/input.bin output.bin   run_hls.tcl   estimates.json   stage.json

Templates are data (templates/*.in, processes.txt; string.Template fields); this module only
fills them. No raw model name reaches the code: identifiers come from `lower.c_identifiers`
(`conv1`, `dense_4`: the human name, a digit-only one led by the layer kind), comments from
`lower.comment_safe`; a process line whose identifier is not its human name ends with that
name (`PIPECC_PROCESS(dense_4, ...)  // 4`). The stage is written to a temporary folder and
renamed into place, so a failure never leaves half a stage.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from string import Template

import numpy as np
import torch
import torch.fx as fx

from pipecc.errors import PipeccError
from pipecc.targets.fpga_model import (FLOAT_MAC_II, LINK_BITS, NumberFormat, parse_number,
                               stage_estimate)

from . import lower as lowering
from .pack import beats_for

TEMPLATES = Path(__file__).parent / "templates"
FLOAT_REL_TOL = 1e-5  # float mode: |csim - torch| <= 1e-5 * max|torch output|
_CONSTANTS = {
    "dense": "n_in n_out n_vec pe simd reuse_factor mac_ii",
    "conv2d": "in_c in_h in_w out_c out_h out_w k_h k_w stride_h stride_w pad_h pad_w groups "
              "fan_in pe simd reuse_factor mac_ii",
    "scale": "channels spatial", "relu": "n", "relu6": "n", "gelu": "n tanh_approx",
    "maxpool2d": "in_c in_h in_w out_h out_w k_h k_w stride_h stride_w pad_h pad_w "
                 "count_include_pad",
    "avgpool2d": "in_c in_h in_w out_h out_w k_h k_w stride_h stride_w pad_h pad_w "
                 "count_include_pad",
    "adaptive_avgpool2d": "in_c in_h in_w out_h out_w bin_h bin_w", "add": "n",
    "concat": "n_a n_b",
}


def _template(name: str) -> Template:
    return Template((TEMPLATES / name).read_text())


def _calls() -> dict[str, Template]:
    lines = (TEMPLATES / "processes.txt").read_text().splitlines()
    pairs = [ln.split(":", 1) for ln in lines if ln.strip() and not ln.startswith("#")]
    return {k.strip(): Template(v.strip()) for k, v in pairs}


def _types(fmt: NumberFormat) -> dict[str, str]:
    if fmt.is_float:
        if fmt.bits != 32:
            raise PipeccError(f"number format {fmt.text!r}: the FPGA backend emits float "
                              "(fp32) or ap_fixed<W,I>")
        return {"data_type": "float", "accum_type": "float", "number_doc": "float (fp32)",
                "accum_doc": "fp32 accumulation"}
    w, i = fmt.bits, fmt.int_bits
    return {"data_type": f"ap_fixed<{w}, {i}, AP_RND_CONV, AP_SAT>",
            "accum_type": f"ap_fixed<{2 * w + 12}, {2 * i + 12}, AP_RND_CONV, AP_SAT>",
            "number_doc": f"{fmt.text}, round to nearest even and saturate (never wrap)",
            "accum_doc": "exact products, 12 guard bits: no rounding inside a sum"}


def _constants(layer: lowering.Layer, est: dict, fmt: NumberFormat) -> dict[str, int]:
    a = dict(layer.spec.attrs)
    for key, pre in (("kernel", "k"), ("stride", "stride"), ("pad", "pad")):
        if key in a:
            a[f"{pre}_h"], a[f"{pre}_w"] = a[key]
    a.update(pe=est["pe"], simd=est["simd"], reuse_factor=est["reuse_factor"],
             mac_ii=FLOAT_MAC_II if fmt.is_float else 1,
             tanh_approx=int(a.get("approximate") == "tanh"),
             count_include_pad=int(a.get("count_include_pad", False)))
    if layer.spec.kind == "conv2d":
        a["fan_in"] = layer.weights["w"].shape[1]
    return {k: int(a[k]) for k in _CONSTANTS.get(layer.spec.kind, "").split()}


def _literal(v: float) -> str:
    return f"{float(np.float32(v)):.9g}"  # 9 significant digits round-trip a float32


def _write_weights(fw: Path, name: str, arr: np.ndarray, ctype: str, comment: str,
                   banner: str) -> tuple[str, str, str]:
    """weights/<name>.h and .bin; returns (#include, csim declaration, csim load line)."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    dims = "".join(f"[{d}]" for d in arr.shape)
    arr.tofile(fw / "weights" / f"{name}.bin")
    flat = [_literal(v) for v in arr.ravel()]
    rows = ",\n".join("  " + ", ".join(flat[i:i + 8]) for i in range(0, len(flat), 8))
    (fw / "weights" / f"{name}.h").write_text(_template("weights.h.in").substitute(
        banner=banner, comment=comment, count=arr.size, ctype=ctype, array=name, dims=dims,
        values=rows))
    first = "[0]" * (arr.ndim - 1)
    return (f'#include "weights/{name}.h"', f"{ctype} {name}{dims};",
            f'  ok = pipecc::load_weights(dir, "{name}.bin", &{name}{first}[0], {arr.size}) && ok;')


def _gelu_table(approximate: str) -> list[str]:
    x = torch.arange(1025, dtype=torch.float64) / 64 - 8
    y = torch.nn.functional.gelu(x, approximate=approximate)
    return [_literal(v) for v in y.tolist()]


def write_fpga_stage(out_dir: str | Path, stage_gm: fx.GraphModule, example_input: torch.Tensor,
                     card: str, number: str = "float", stage_index: int = 0) -> Path:
    """Write `out_dir/stage_<i>/` for a stage placed on FPGA `card`; returns that folder."""
    fmt = parse_number(number)
    types = _types(fmt)
    stage = lowering.lower(stage_gm, example_input)  # raises before any file exists
    layers = stage.layers
    est = stage_estimate([l.spec for l in layers], card, fmt)
    top, guard = f"pipecc_stage{stage_index}", f"PIPECC_STAGE{stage_index}"
    banner = (f"Generated by pipecc (backends/fpga) for pipeline stage {stage_index}; "
              "edit the model, not this file.")
    bound = lowering.error_bound(layers, fmt)
    ref = float(stage.golden_output.abs().max())
    tol = FLOAT_REL_TOL * max(ref, 1e-30) if fmt.is_float else bound * 1.01 + 1e-12
    n_in, n_out = layers[0].spec.numel_out, layers[-1].spec.numel_in
    in_shape, out_shape = layers[0].spec.out_shape, layers[-1].spec.out_shape

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".stage_{stage_index}_", dir=out_dir))
    try:
        fw = tmp / "firmware"
        for sub in ("firmware/weights", "tb", "tb_data", "csim_include"):
            (tmp / sub).mkdir(parents=True)
        for name in ("pipecc_layers.h", "pack.h"):
            shutil.copy(TEMPLATES / name, fw / name)
        shutil.copy(TEMPLATES / "hls_stream.h", tmp / "csim_include" / "hls_stream.h")

        calls = _calls()
        configs, includes, decls, loads, streams, procs = [], [], [], [], [], []
        extra: list[str] = []
        stream_of: dict[str, list[str]] = {}   # tensor id -> streams still to be read
        for layer, e in zip(layers, est["layers"]):
            s, name = layer.spec, layer.ident
            ins = [stream_of[t].pop(0) for t in s.inputs]
            outs = [f"s_{name}"] if s.kind != "clone" else \
                [f"s_{name}_{k}" for k in range(s.attrs["copies"])]
            if s.tensor:
                depth = s.numel_out if s.kind == "clone" else 2  # skip paths hold a frame
                for o in outs:
                    streams.append(f'  hls::stream<data_t> {o}("{o}");\n'
                                   f"#pragma HLS STREAM variable={o} depth={depth}\n"
                                   f"  PIPECC_SET_DEPTH({o}, {depth})")
                stream_of[s.tensor] = list(outs)
            kind = "gelu_table" if s.kind == "gelu" and not fmt.is_float else s.kind
            fields = {"name": name, "out": outs[0], "outs": ", ".join(outs), "n": s.attrs["n"],
                      "approximate": s.attrs.get("approximate", "none"),
                      **{f"in{k}": v for k, v in enumerate(ins)}}
            human = f"  // {layer.label}" if layer.label != name else ""  # dense_4  // 4
            procs.append(f"  PIPECC_PROCESS({name}, {calls[kind].substitute(fields)}){human}")
            if s.kind in _CONSTANTS:
                consts = "\n".join(f"  static const unsigned {k} = {v};"
                                   for k, v in _constants(layer, e, fmt).items())
                comment = f"{layer.label} [{s.kind}] <- {', '.join(layer.sources)}"
                configs.append(_template("config.h.in").substitute(
                    comment=comment, name=name, constants=consts))
            for role, ctype in (("w", "weight_t"), ("b", "bias_t")):
                if role in layer.weights:
                    inc, decl, load = _write_weights(fw, f"{role}_{name}", layer.weights[role],
                                                     ctype, f"{layer.label} [{s.kind}]", banner)
                    includes.append(inc)
                    decls.append(decl)
                    loads.append(load)
            table = f"pipecc_gelu_{fields['approximate']}"
            if kind == "gelu_table" and f'#include "{table}.h"' not in extra:
                body = ",\n".join("  " + ", ".join(chunk) for chunk in
                                  _chunks(_gelu_table(fields["approximate"]), 8))
                (fw / f"{table}.h").write_text(f"// {banner}\n// gelu(x), x = -8 + k/64.\n"
                                               f"static const data_t {table}[1025] = {{\n{body}\n}};\n")
                extra.append(f'#include "{table}.h"')

        common = dict(banner=banner, top=top, guard=guard, card=est["card"], part=est["part"],
                      stage_index=stage_index, tolerance=repr(tol))
        files = {
            fw / "defines.h": _template("defines.h.in").substitute(
                common, **types, link_bits=LINK_BITS, data_bits=fmt.bits, n_input=n_in,
                n_output=n_out, in_shape=list(in_shape), out_shape=list(out_shape),
                input_beats=beats_for(n_in, fmt.bits), output_beats=beats_for(n_out, fmt.bits)),
            fw / "parameters.h": _template("parameters.h.in").substitute(
                common, configs="\n".join(configs)),
            fw / f"{top}.h": _template("top.h.in").substitute(common),
            fw / f"{top}.cpp": _template("top.cpp.in").substitute(
                common, summary=f"{len(layers)} processes, {fmt.text}",
                extra_includes="\n".join(extra), weight_includes="\n".join(includes),
                weight_decls="\n".join(decls), weight_loads="\n".join(loads),
                streams="\n".join(streams), processes="\n".join(procs)),
            tmp / "tb" / f"{top}_tb.cpp": _template("tb.cpp.in").substitute(
                common, batch=stage.example_input.shape[0], in_shape=list(in_shape)),
            tmp / "tb" / f"{top}_bridge.cpp": _template("bridge.cpp.in").substitute(common),
            tmp / "run_hls.tcl": _template("run_hls.tcl.in").substitute(
                common, clock_mhz=f"{est['clock_hz'] / 1e6:g}",
                clock_ns=f"{1e9 / est['clock_hz']:g}"),
        }
        for path, text in files.items():
            path.write_text(text)
        stage.example_input.numpy().tofile(tmp / "tb_data" / "input.bin")
        stage.golden_output.numpy().tofile(tmp / "tb_data" / "output.bin")
        (tmp / "estimates.json").write_text(json.dumps(est, indent=1) + "\n")
        meta = {"top": top, "card": est["card"], "number": fmt.text, "stage_index": stage_index,
                "in_shape": list(in_shape), "out_shape": list(out_shape),
                "batch": int(stage.example_input.shape[0]), "link_bits": LINK_BITS,
                "tolerance": tol, "error_bound": bound, "max_ref": ref,
                "error_sigma": lowering.error_sigma(layers, fmt),
                "tolerance_rule": "float: 1e-5 x max|torch output|" if fmt.is_float else
                "fixed: propagated worst-case rounding bound (lower.error_bound) x 1.01",
                "saturation": lowering.saturation(layers, fmt),
                "layers": [{"ident": l.ident, "name": l.spec.name, "kind": l.spec.kind,
                            "nodes": list(l.spec.nodes)} for l in layers]}
        (tmp / "stage.json").write_text(json.dumps(meta, indent=1) + "\n")
        final = out_dir / f"stage_{stage_index}"
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _chunks(items: list[str], n: int) -> list[list[str]]:
    return [items[i:i + n] for i in range(0, len(items), n)]


"""ONNX frontend: load, check, infer shapes, and build the same annotated fx graph.

Every ONNX node becomes a `call_function` to its torch implementation in `pipecc.frontend.onnx_ops`
(attributes as keyword arguments), float initializers become parameters of the root module
(so they count as weights that need gradients, like a PyTorch model's), other initializers
become buffers. Shapes come from ONNX shape inference with data propagation; a symbolic
batch dimension (`dim_param`) becomes the symbol B, other named dims become symbols too.
"""

from __future__ import annotations

import builtins
import keyword
from pathlib import Path
from typing import Any

import numpy as np
import sympy
import torch
import torch.fx as fx

from pipecc.errors import PipeccError
from pipecc.frontend.torch_capture import annotate_ops_and_names
from pipecc.ir.graph import META_KIND, META_NAME, META_VALUE, AnnotatedGraph, TensorInfo
from pipecc.frontend.onnx_ops import IMPLEMENTATIONS, unsupported


def _load(path: Path):
    import onnx
    if not path.exists():
        raise PipeccError(f"ONNX file {str(path)!r} does not exist")
    try:
        model = onnx.load(str(path))
    except Exception as exc:
        raise PipeccError(f"{path.name} is not a readable ONNX file ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); re-export it") from exc
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise PipeccError(f"{path.name} fails the ONNX checker: {str(exc).splitlines()[0][:200]}") from exc
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:
        raise PipeccError(f"ONNX shape inference failed on {path.name}: {str(exc).splitlines()[0][:200]}") from exc


def _dtype(elem_type: int) -> torch.dtype:
    from onnx.helper import tensor_dtype_to_np_dtype
    try:
        return torch.from_numpy(np.zeros((), dtype=tensor_dtype_to_np_dtype(elem_type))).dtype
    except (TypeError, KeyError):
        return torch.float32


def _sanitize(name: str, taken: set[str]) -> str:
    """An ONNX name as an fx name: an ASCII identifier that is no keyword, builtin or
    nn.Module attribute (ONNX names are any strings: `in`, `None`, `²`, CR, ESC...)."""
    base = "".join(c if c.isascii() and c.isalnum() else "_" for c in name).strip("_") or "v"
    if base[0].isdigit():
        base = "v_" + base
    if keyword.iskeyword(base) or keyword.issoftkeyword(base) or hasattr(builtins, base) \
            or hasattr(torch.nn.Module, base) or base in ("self", "torch", "F"):
        base += "_"
    out, k = base, 1
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


def from_onnx(path: str | Path, batch_size: int = 1) -> AnnotatedGraph:
    """Import an ONNX file. `batch_size` is the value of B when the batch dim is symbolic."""
    from onnx import numpy_helper
    path = Path(path)
    model = _load(path)
    graph = model.graph
    _check_supported(path, graph)
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    notes: list[str] = []
    real_inputs = [i for i in graph.input if i.name not in inits]
    batched = [k for k, vi in enumerate(real_inputs) if _dim0_symbolic(vi)]
    observed = _observe(model, real_inputs, batch_size, batched, notes)

    root = torch.nn.Module()
    fxg = fx.Graph()
    env: dict[str, fx.Node] = {}
    taken: set[str] = set()
    for vi in real_inputs:
        env[vi.name] = fxg.placeholder(_sanitize(vi.name, taken))
    stats = _running_stats(graph)
    for name, array in inits.items():
        attr = _sanitize(name, taken)
        tensor = torch.from_numpy(np.array(array))
        if tensor.is_floating_point() and name not in stats:
            root.register_parameter(attr, torch.nn.Parameter(tensor))
        else:
            root.register_buffer(attr, tensor)
        node = fxg.get_attr(attr)
        env[name] = node

    missing: set[str] = set()
    for onode in graph.node:
        attrs = {a.name: _attr_value(a) for a in onode.attribute}
        if onode.op_type == "Constant":
            value = attrs.get("value")
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(
                next(iter(attrs.values())))
            attr = _sanitize(onode.output[0], taken)
            root.register_buffer(attr, tensor)
            env[onode.output[0]] = fxg.get_attr(attr)
            continue
        fn = IMPLEMENTATIONS.get(onode.op_type)
        if fn is None:
            fn = unsupported(onode.op_type)
            missing.add(onode.op_type)
        args = tuple(env[i] if i else None for i in onode.input)
        call = fxg.call_function(fn, args, attrs)
        call.name = _sanitize(onode.name or onode.output[0], taken)
        call.meta["pipecc.onnx_name"] = onode.name or onode.output[0]
        outs = [o for o in onode.output]
        if len(outs) == 1 and getattr(fn, "__pipecc_outputs__", 1) > 1:
            import operator  # the implementation returns all outputs; the node uses the first
            env[outs[0]] = fxg.call_function(operator.getitem, (call, 0))
        elif len(outs) == 1:
            env[outs[0]] = call
        else:
            import operator
            for i, o in enumerate(outs):
                if o:
                    env[o] = fxg.call_function(operator.getitem, (call, i))
    results = [env[o.name] for o in graph.output]
    fxg.output(results[0] if len(results) == 1 else tuple(results))
    gm = fx.GraphModule(root, fxg, class_name=f"Onnx_{_sanitize(path.stem, set())}")

    B = sympy.Symbol("B", positive=True, integer=True)
    syms, point = ({"B": B}, {B: batch_size}) if batched else ({}, {})
    _annotate_values(gm, graph, observed, B if batched else None, batch_size, notes)
    annotate_ops_and_names(gm)
    for node in gm.graph.nodes:  # human names: the ONNX node names the user knows
        if "pipecc.onnx_name" in node.meta:
            node.meta[META_NAME] = node.meta["pipecc.onnx_name"]
        if node.meta[META_KIND] == "embedding" and node.args and \
                getattr(node.args[0], "op", None) != "get_attr":
            node.meta[META_KIND] = "shape"  # a Gather on activations moves data, no table
    _dedupe_names(gm)
    if missing:
        notes.append(f"no torch implementation for ONNX ops {', '.join(sorted(missing))}: "
                     "costs are computed, but the graph cannot be executed")
    if not batched and batch_size != 1:
        notes.append(f"{path.name} has a fixed batch size; --batch-size {batch_size} is ignored")
    if not batched:  # the batch the file fixes (its first input's dim 0), for messages about splitting it
        dims = [d.dim_value for vi in real_inputs[:1] for d in vi.type.tensor_type.shape.dim[:1]
                if d.HasField("dim_value")]
        gm.meta["pipecc.fixed_batch"] = int(dims[0]) if dims else None
    return AnnotatedGraph(gm=gm, symbols=syms, point=point, source="onnx",
                          model_name=path.stem, warnings=notes)


def _check_supported(path: Path, graph: Any) -> None:
    """Refuse, in one line at import, what the generated stage code could never run: a graph
    without outputs, and control flow with subgraphs (If, Loop, Scan: attributes that hold
    graphs), which would otherwise become stage code that does not even parse."""
    from onnx import AttributeProto
    if not len(graph.output):
        raise PipeccError(f"{path.name} declares no graph outputs, so there is nothing to compute or train; "
                          "export it with its outputs")
    for node in graph.node:
        if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute):
            raise PipeccError(f"{path.name}: node {node.name or node.output[0]!r} is an ONNX {node.op_type} (control "
                              "flow over subgraphs), which pipecc cannot cut into stages; export the model with the "
                              "branch or loop resolved (a fixed path, e.g. torch.where instead of if)")


def unsupported_ops(gm: fx.GraphModule) -> list[str]:
    """The ONNX op types in ``gm`` that pipecc costs but cannot execute (sorted)."""
    return sorted({str(n.target.__pipecc_onnx_unsupported__) for n in gm.graph.nodes
                   if n.op == "call_function" and getattr(n.target, "__pipecc_onnx_unsupported__", None)})


def check_executable(gm: fx.GraphModule) -> None:
    """Refuse (one line) compiling a graph with ONNX ops pipecc costs but cannot execute: `plan`
    and `cost` work on it, a compiled stage could not run it."""
    ops = unsupported_ops(gm)
    if ops:
        raise PipeccError(f"ONNX op{'s' if len(ops) > 1 else ''} {', '.join(ops)} {'have' if len(ops) > 1 else 'has'} "
                          "no torch implementation in pipecc: `pipecc plan` and `cost` work on this model, but a "
                          "compiled stage could not run it; replace the op in the export (or plan only)")


def _running_stats(graph: Any) -> set[str]:
    """Initializers used only as BatchNormalization mean/var: buffers, not weights."""
    stat_uses: set[str] = set()
    other_uses: set[str] = set()
    for node in graph.node:
        for i, name in enumerate(node.input):
            (stat_uses if node.op_type == "BatchNormalization" and i in (3, 4) else other_uses).add(name)
    return stat_uses - other_uses


def _attr_value(attr: Any) -> Any:
    from onnx import helper, numpy_helper
    value = helper.get_attribute_value(attr)
    if hasattr(value, "dims") and hasattr(value, "data_type"):  # TensorProto
        return torch.from_numpy(np.array(numpy_helper.to_array(value)))
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


def _dim0_symbolic(vi: Any) -> bool:
    dims = vi.type.tensor_type.shape.dim
    return len(dims) > 0 and not dims[0].HasField("dim_value")


def _feeds(inputs: list, batch: int, batched: list[int]) -> dict[str, np.ndarray]:
    """Inputs for one observation run: zeros (valid token ids too) at the given batch."""
    from onnx.helper import tensor_dtype_to_np_dtype
    feeds = {}
    for k, vi in enumerate(inputs):
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]
        if k in batched:
            shape[0] = batch
        feeds[vi.name] = np.zeros(shape, dtype=tensor_dtype_to_np_dtype(t.elem_type))
    return feeds


def _observe(model: Any, inputs: list, batch: int, batched: list[int], notes: list[str]) -> list[dict]:
    """Run onnxruntime at batch b, b+1 (and b+3 to check), recording every value's shape.

    Shapes are observed rather than inferred: ONNX shape inference leaves many dims unknown
    (`unk__N`) in exported graphs, while a run knows them all. The fit to B is the same
    multilinear fit the PyTorch frontend uses.
    """
    import onnx
    import onnxruntime as ort
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        for out in node.output:
            if out and out not in known:
                probe.graph.output.append(onnx.ValueInfoProto(name=out))
                known.add(out)
    del probe.graph.value_info[:]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise PipeccError(f"onnxruntime cannot load the model: {str(exc).splitlines()[0][:200]}") from exc
    names = [o.name for o in session.get_outputs()]
    runs = []
    for b in ([batch, batch + 1, batch + 3] if batched else [batch]):
        try:
            values = session.run(names, _feeds(inputs, b, batched))
        except Exception as exc:
            raise PipeccError(f"onnxruntime failed to run the model at batch {b}: "
                              f"{str(exc).splitlines()[0][:200]}") from exc
        runs.append({n: _describe_np(v) for n, v in zip(names, values)})
    return runs


def _describe_np(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return ("T", tuple(int(d) for d in v.shape), torch.from_numpy(np.zeros((), v.dtype)).dtype, False)
    if isinstance(v, list):
        return tuple(_describe_np(x) for x in v)
    return ("S", None)


def _annotate_values(gm: fx.GraphModule, graph: Any, runs: list[dict], b_symbol: Any,
                     batch: int, notes: list[str]) -> None:
    """META_VALUE from the observed runs; requires_grad flows from float parameters."""
    from pipecc.frontend.torch_capture import _fit_value
    corners = [(0,), (1,)] if b_symbol is not None else [()]
    us = [b_symbol - batch] if b_symbol is not None else []
    syms = {"B": b_symbol} if b_symbol is not None else {}
    check_values = {"B": batch + 3}
    onnx_out = {(onode.name or onode.output[0]): list(onode.output) for onode in graph.node}
    placeholders = iter(vi.name for vi in graph.input if vi.name not in
                        {i.name for i in graph.initializer})

    sizes = [batch, batch + 1, batch + 3] if b_symbol is not None else [batch]

    def fitted(name: str, observed: list, rg: bool) -> Any:
        if observed[0] is None:
            return None
        check = observed[2] if len(observed) > 2 else None
        value, ok = _fit_value(observed[:len(corners)], check, corners, us, syms, check_values)
        if not ok:
            notes.append(f"shape of {name} is not linear in B; kept at its example value")
        return _with_grad(value, rg)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = next(placeholders)
            node.meta[META_VALUE] = fitted(name, [_input_desc(graph, name, b) for b in sizes], False)
        elif node.op == "get_attr":
            t = getattr(gm, str(node.target))
            node.meta[META_VALUE] = TensorInfo(tuple(t.shape), t.dtype, isinstance(t, torch.nn.Parameter))
        elif node.op == "call_function" and "pipecc.onnx_name" in node.meta:
            outs = onnx_out.get(node.meta["pipecc.onnx_name"], [])
            rg = any(_rg(a.meta.get(META_VALUE)) for a in node.all_input_nodes)
            vals = [fitted(o, [r.get(o) for r in runs], rg) for o in outs]
            node.meta[META_VALUE] = vals[0] if len(vals) == 1 else tuple(vals)
        elif node.op == "call_function":  # getitem of a multi-output node
            parent, idx = node.args
            v = parent.meta.get(META_VALUE)
            node.meta[META_VALUE] = v[idx] if isinstance(v, tuple) else v
        else:
            node.meta[META_VALUE] = None


def _input_desc(graph: Any, name: str, batch: int) -> Any:
    vi = next(v for v in graph.input if v.name == name)
    t = vi.type.tensor_type
    shape = tuple(d.dim_value if d.HasField("dim_value") else (batch if i == 0 else 1)
                  for i, d in enumerate(t.shape.dim))
    return ("T", shape, _dtype(t.elem_type), False)


def _rg(value: Any) -> bool:
    if isinstance(value, TensorInfo):
        return value.requires_grad
    if isinstance(value, tuple):
        return any(_rg(v) for v in value)
    return False


def _with_grad(value: Any, rg: bool) -> Any:
    if isinstance(value, TensorInfo):
        return TensorInfo(value.shape, value.dtype, rg and value.dtype.is_floating_point)
    if isinstance(value, tuple):
        return tuple(_with_grad(v, rg) for v in value)
    return value


def _dedupe_names(gm: fx.GraphModule) -> None:
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if META_NAME not in node.meta:
            continue
        name, k = node.meta[META_NAME], 1
        while node.meta[META_NAME] in seen:
            node.meta[META_NAME] = f"{name}_{k}"
            k += 1
        seen.add(node.meta[META_NAME])

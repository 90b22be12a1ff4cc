"""PyTorch frontend: capture an nn.Module as an fx graph and annotate shapes symbolically.

Capture: torch.fx first (`fx_tracer.trace`: fast, keeps leaf modules such as nn.Linear and
nn.LSTM as single nodes with their module path, and traces into composite ones such as
nn.TransformerEncoderLayer); when it fails (Python control flow on shapes, Hugging Face
models) fall back to `torch.export` and say so in a warning.

The user's model is never changed: every run of its forward here is over fake copies of its
weights (`model_state.fake_weights`), and the one real run (a forward that fake tensors cannot
run) restores what it changed (`model_state.preserved_state`). torch's own loggers are muted
while we capture: a forward that fails is reported once, in one line, by us.

Symbolic shapes by fitting, not by symbolic tracing: shapes are propagated with fake tensors
(no memory, no FLOPs) at a few values of each symbol, and every dimension is fitted as a
multilinear polynomial in the symbols (d = a + b·B, or a + b·B + c·S + e·B·S with two
symbols), then checked at one more point. This works for every op that has a fake kernel
(nn.LSTM has none under symbolic shapes, which rules torch's own ShapeEnv out) and is exact
for the shapes deep-learning models produce; a dimension that fails the check is kept at its
example value and reported. A node fake tensors cannot run because its output depends on
tensor values (boolean-mask indexing, `nonzero`, `unique`, `masked_select`: a data-dependent
shape; `.item()`: a value read into Python) stops the analysis with one line naming the node
and a fixed-shape rewrite (`_data_dependent_message`), not with the fixed-size fallback.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import warnings as pywarnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from pipecc.errors import CaptureError, PipeccError, UsageError
from pipecc.frontend import capture_errors, constants, fx_tracer, host_random, model_checks, regions
from pipecc.frontend.modes import capture_both
from pipecc.frontend.model_state import fake_weights, preserved_state, shape_safe_batchnorm
from pipecc.ir.graph import (META_KIND, META_NAME, META_OP, META_PARAMS, META_VALUE, AnnotatedGraph,
                       ScalarInfo, TensorInfo, tensors_in)
from pipecc.ir.ops import node_op, op_kind


@dataclass(frozen=True)
class SymbolSpec:
    """A symbolic dimension: `name` stands for dim `dim` of every input listed in `inputs`."""

    name: str
    inputs: tuple[int, ...]
    dim: int


def capture(model: torch.nn.Module, example_inputs: tuple,
            symbols: Sequence[SymbolSpec] = ()) -> tuple[fx.GraphModule, str, list[str]]:
    """Trace with fx, falling back to torch.export. Returns (graph module, source, warnings).

    torch.export is asked to keep the symbols' dims dynamic (`Dim.AUTO`), so the exported
    graph does not bake the example batch size into its reshapes.
    """
    notes: list[str] = []
    try:
        gm = _fx_trace(model, len(example_inputs))
        return gm, "fx", notes
    except PipeccError:  # names fx cannot write: torch.export writes code the same way
        raise
    except Exception as exc:  # fx raises many types (TraceError, TypeError, ...)
        fx_exc = exc
        fx_error = f"{type(fx_exc).__name__}: {_first_line(fx_exc)}"
    try:
        with pywarnings.catch_warnings(), _quiet_torch_logs():
            pywarnings.simplefilter("ignore")
            dynamic: list[dict[int, Any] | None] = [None] * len(example_inputs)
            for spec in symbols:
                for i in spec.inputs:
                    dynamic[i] = {**(dynamic[i] or {}), spec.dim: torch.export.Dim.AUTO}
            try:
                exported = torch.export.export(model, tuple(example_inputs), strict=False,
                                               dynamic_shapes=tuple(dynamic))
            except Exception:  # e.g. forward(*args) wants nested specs: export static
                exported = torch.export.export(model, tuple(example_inputs), strict=False)
            gm = exported.module()
    except Exception as exp_exc:
        opaque = [name for name, m in model.named_modules() if fx_tracer.sees_into(m)]
        if opaque:  # last resort: keep them whole (costed by a guess, not compilable)
            with contextlib.suppress(Exception):
                gm = _fx_trace(model, len(example_inputs), see_into=False)
                notes.append(f"could not trace into {', '.join(opaque[:3])} ({fx_error}); they "
                             "are kept as opaque modules")
                return gm, "fx", notes
        export_why = type(exp_exc).__name__
        named = capture_errors.explain(fx_exc, export_why)  # the construct and the way out
        if named is not None:
            raise _Refinable(exp_exc, named, capture_errors.fx_site(fx_exc)) from exp_exc
        raise _Refinable(
            exp_exc,
            f"could not capture the model: torch.fx failed ({fx_error}) and torch.export failed "
            f"({type(exp_exc).__name__}: {_first_line(exp_exc)}); remove data-dependent Python "
            "control flow from forward"
        ) from exp_exc
    for node in list(gm.graph.nodes):  # export's input guards are checks, not model work
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            gm.graph.erase_node(node)
        # NOTE: a tied weight is read under one of its names; the others stay as get_attr nodes
        # nothing uses, and the first of them would own the weight (`annotate_ops_and_names`)
        # in a unit that never reads it
        elif node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    regions.inline_no_grad(gm)  # torch.no_grad() blocks: ops on detached inputs
    notes.append(f"torch.fx could not trace the model ({fx_error}); captured with torch.export")
    return gm, "export", notes


class _EagerDraw(Exception):
    """torch.fx ran a random function for real while tracing (`torch.rand([])`: no Proxy among
    its arguments), so its graph would replay that one draw forever; torch.export keeps the
    draw as an operator, so the capture falls back to it."""


def _fx_trace(model: torch.nn.Module, n_inputs: int, **kwargs: Any) -> fx.GraphModule:
    """`fx_tracer.trace`, refusing (`_EagerDraw`) a trace that drew from torch's generator."""
    rng = torch.get_rng_state()
    gm = fx_tracer.trace(model, n_inputs, **kwargs)
    if not torch.equal(rng, torch.get_rng_state()):
        torch.set_rng_state(rng)
        raise _EagerDraw("forward drew torch random numbers that no input flows into while "
                         "torch.fx traced it, which fx would keep as constants")
    return gm


class _Refinable(CaptureError):
    """Both routes failed; `from_module` may name the construct better with what the forward
    check saw (`_refined`): the model's line where it branched (`site`: fx's, else the one in
    `export_exc`'s traceback) and the random draws before it."""

    def __init__(self, export_exc: BaseException, message: str,
                 site: Any = None) -> None:
        super().__init__(message)
        self.export_exc, self.site = export_exc, site


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export prints guard failures and graphs on stderr (through handlers that ignore
    logger levels); we report failures ourselves, so stderr is muted at the fd level."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def quiet_torch_logging() -> Iterator[None]:
    """Mute torch's loggers (fake tensors log every failing kernel at ERROR, with its
    traceback); their levels are restored after."""
    manager = logging.Logger.manager
    names = ["torch"] + [n for n in list(manager.loggerDict) if n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL + 1)
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# ----------------------------------------------------------------------------- shapes
class _Recorder(fx.Interpreter):
    """Runs the graph under a FakeTensorMode and records every node's output."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        from pipecc.frontend.modelfile import held
        try:
            with held():  # the time limit ends the run between nodes, never inside torch's dispatch
                out = super().run_node(n)
        except _DATA_DEPENDENT as exc:
            raise PipeccError(_data_dependent_message(n, exc, self.values)) from exc
        self.values[n] = _describe(out)
        return out


def _data_dependent_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    return DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode


_DATA_DEPENDENT = _data_dependent_errors()


def _data_dependent_message(node: fx.Node, exc: BaseException, seen: dict[fx.Node, Any]) -> str:
    """One line for a node fake tensors cannot run: its output (shape or value) depends on the
    values of a tensor (boolean-mask indexing, nonzero, unique, masked_select, .item()).

    NOTE: pipecc needs every node's shape before any real data exists (costs, stage ports,
    generated code), so such a node cannot be planned; the message says how to rewrite it."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException
    what = _node_call(node, seen)
    if isinstance(exc, DynamicOutputShapeException):
        return (f"node {node.name} ({what}): its output shape depends on the tensor's values, so "
                "pipecc cannot cost or pipeline it (shapes must be known at compile time); write it "
                "with a fixed shape (torch.where(mask, x, 0) or x * mask, e.g. (h * m).sum() / "
                "m.sum() for h[m].mean()) or keep it out of the traced model")
    return (f"node {node.name} ({what}) reads a tensor's value into Python, so pipecc cannot "
            "propagate shapes through it at compile time; keep the value a tensor (x * t instead "
            "of x * t.item()) or keep it out of the traced model")


def _node_call(node: fx.Node, seen: dict[fx.Node, Any]) -> str:
    """`boolean-mask indexing h[mask]`, `.nonzero()`, `torch.unique(...)`: what the node calls."""
    import operator
    if node.op == "call_function" and node.target is operator.getitem:
        index = node.args[1] if len(node.args) > 1 else None
        parts = index if isinstance(index, (tuple, list)) else (index,)
        masks = [seen.get(p) for p in parts if isinstance(p, fx.Node)]
        if any(isinstance(m, tuple) and len(m) == 4 and m[0] == "T" and m[2] == torch.bool for m in masks):
            return "boolean-mask indexing x[mask]"
        return "indexing with a tensor"
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_module":
        return f"module {node.target}"
    target = getattr(node.target, "__name__", str(node.target))
    module = getattr(node.target, "__module__", None) or ""
    return f"{'torch.' if module.startswith('torch') else ''}{target}()"


def _describe(x: Any) -> Any:
    """Concrete structure of a runtime value: ('T', shape, dtype, rg) / tuples / ('S', v)."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(int(d) for d in x.shape), x.dtype, bool(x.requires_grad))
    if isinstance(x, torch.Size):
        return ("S", tuple(int(d) for d in x))
    if isinstance(x, (tuple, list)):
        return tuple(_describe(v) for v in x)
    if isinstance(x, (int, float, bool, str)) or x is None:
        return ("S", x)
    return ("S", None)


def _fake_inputs(mode: FakeTensorMode, inputs: tuple, sizes: dict[tuple[int, int], int]) -> tuple:
    """Fake copies of the inputs with some dims resized; `sizes[(input, dim)] = n`."""
    out = []
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            shape = [sizes.get((i, d), s) for d, s in enumerate(x.shape)]
            with mode:
                fake = torch.empty(shape, dtype=x.dtype, device=x.device)
            out.append(fake.requires_grad_(x.requires_grad))
        else:
            out.append(x)
    return tuple(out)


def _run_fake(gm: fx.GraphModule, inputs: tuple, sizes: dict[tuple[int, int], int]) -> dict:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_inputs(mode, inputs, sizes)
    rec = _Recorder(gm)
    with fake_weights(gm, mode), shape_safe_batchnorm(gm), mode, pywarnings.catch_warnings():
        pywarnings.simplefilter("ignore")
        rec.run(*fake)
    return rec.values


def default_symbols(inputs: tuple, batch_size: int) -> list[SymbolSpec]:
    """`B` is dim 0 of every tensor input whose first dim equals the batch size."""
    batched = tuple(i for i, x in enumerate(inputs)
                    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size)
    return [SymbolSpec("B", batched, 0)] if batched else []


def propagate_shapes(gm: fx.GraphModule, inputs: tuple, symbols: Sequence[SymbolSpec],
                     ) -> tuple[dict[str, sympy.Symbol], dict[sympy.Symbol, int], list[str]]:
    """Annotate META_VALUE on every node with shapes multilinear in the symbols.

    Runs the graph 2^k + 1 times under fake tensors (k = number of symbols).
    """
    syms = {s.name: sympy.Symbol(s.name, positive=True, integer=True) for s in symbols}
    base = {}
    for s in symbols:
        x = inputs[s.inputs[0]]
        base[s.name] = int(x.shape[s.dim])
    point = {syms[s.name]: base[s.name] for s in symbols}

    def sizes_for(values: dict[str, int]) -> dict[tuple[int, int], int]:
        return {(i, s.dim): values[s.name] for s in symbols for i in s.inputs}

    corners = list(itertools.product((0, 1), repeat=len(symbols)))
    runs = []
    for corner in corners:
        values = {s.name: base[s.name] + c for s, c in zip(symbols, corner)}
        runs.append(_run_fake(gm, inputs, sizes_for(values)))
    check_values = {s.name: base[s.name] + 3 for s in symbols}
    check = _run_fake(gm, inputs, sizes_for(check_values)) if symbols else runs[0]
    notes: list[str] = []
    us = [syms[s.name] - base[s.name] for s in symbols]  # u_s in {0, 1} at the corners
    for node in gm.graph.nodes:
        observed = [r.get(node) for r in runs]
        value, ok = _fit_value(observed, check.get(node), corners, us, syms, check_values)
        if not ok:
            notes.append(f"shape of {node.name} is not multilinear in "
                         f"{', '.join(syms)}; kept at its example value")
        node.meta[META_VALUE] = value
    return syms, point, notes


def _fit_value(observed: list, check: Any, corners, us, syms, check_values) -> tuple[Any, bool]:
    first = observed[0]
    if first is None:
        return None, True
    if isinstance(first, tuple) and first and first[0] == "T":
        if any(o is None or o[0] != "T" or len(o[1]) != len(first[1]) for o in observed):
            return _const(first), False
        dims, ok = [], True
        for d in range(len(first[1])):
            expr, good = _fit_dim([o[1][d] for o in observed], check, d, corners, us, syms,
                                  check_values)
            dims.append(expr)
            ok &= good
        return TensorInfo(tuple(dims), first[2], first[3]), ok
    if isinstance(first, tuple) and first and first[0] == "S":
        return ScalarInfo(first[1]), True
    if isinstance(first, tuple):
        parts, ok = [], True
        for idx in range(len(first)):
            sub = [o[idx] if isinstance(o, tuple) and len(o) == len(first) else None for o in observed]
            chk = check[idx] if isinstance(check, tuple) and len(check) == len(first) else None
            v, good = _fit_value(sub, chk, corners, us, syms, check_values)
            parts.append(v)
            ok &= good
        return tuple(parts), ok
    return None, True


def _fit_dim(vals: list[int], check: Any, d: int, corners, us, syms, check_values):
    """Möbius inversion over the corners, then verify at the check point."""
    if all(v == vals[0] for v in vals):
        expr: Any = vals[0]
    else:
        expr = sympy.Integer(0)
        for mask_i, mask in enumerate(corners):
            coeff = 0
            for sub_i, sub in enumerate(corners):
                if all(s <= m for s, m in zip(sub, mask)):
                    coeff += (-1) ** (sum(mask) - sum(sub)) * vals[sub_i]
            if coeff:
                term = sympy.Integer(coeff)
                for u, bit in zip(us, mask):
                    if bit:
                        term = term * u
                expr += term
        expr = sympy.expand(expr)
    if check is None or not (isinstance(check, tuple) and check[0] == "T") or d >= len(check[1]):
        return expr, True
    at = int(expr.subs({syms[k]: v for k, v in check_values.items()})) if isinstance(expr, sympy.Expr) else expr
    if at != check[1][d]:
        return vals[0], False
    return expr, True


def _const(desc: Any) -> Any:
    return TensorInfo(desc[1], desc[2], desc[3])


# ----------------------------------------------------------------------------- names
def annotate_ops_and_names(gm: fx.GraphModule) -> None:
    """META_OP, META_KIND, META_NAME and META_PARAMS for every node."""
    taken: set[str] = set()
    seen_params: set[int] = set()
    for node in gm.graph.nodes:
        op = node_op(node, gm)
        node.meta[META_OP] = op
        node.meta[META_KIND] = op_kind(op)
        node.meta[META_NAME] = _unique(_human_name(node, op), taken)
        params = []
        if node.op == "call_module":
            for pname, p in gm.get_submodule(node.target).named_parameters():
                if id(p) not in seen_params:
                    seen_params.add(id(p))
                    params.append((f"{node.target}.{pname}", _info(p)))
        elif node.op == "get_attr":
            obj = _get_attr(gm, str(node.target))
            if isinstance(obj, torch.nn.Parameter) and id(obj) not in seen_params:
                seen_params.add(id(obj))
                params.append((str(node.target), _info(obj)))
        node.meta[META_PARAMS] = params


def _info(p: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(int(d) for d in p.shape), p.dtype, bool(p.requires_grad))


def _get_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _human_name(node: fx.Node, op: str) -> str:
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    if node.op == "placeholder":
        return f"input.{node.target}"
    if node.op == "output":
        return "output"
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = list(stack.values())[-1][0]
        path = path.replace("L['self'].", "").replace("L__self___", "")
        if path.startswith("_empty_nn_module_stack_from_metadata_hook"):
            path = ""  # torch.export's stand-in for a node made outside every module (issue 30)
    op_part = op.split(":")[-1].split(".")[-1]
    return f"{path}.{op_part}" if path else op_part


def _unique(name: str, taken: set[str]) -> str:
    candidate, k = name, 1
    while candidate in taken:
        candidate = f"{name}_{k}"
        k += 1
    taken.add(candidate)
    return candidate


def from_module(model: torch.nn.Module, example_inputs: tuple, *,
                symbols: Sequence[SymbolSpec] | None = None, model_name: str = "model",
                batch_size: int | None = None) -> AnnotatedGraph:
    """Capture and annotate (shapes, ops, names). Costs are added by `pipecc.cost.annotate`."""
    example_inputs = tuple(example_inputs)
    if symbols is None:
        b = batch_size
        if b is None:
            first = next((x for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
            b = int(first.shape[0]) if first is not None else 1
        symbols = default_symbols(example_inputs, b)
    check_symbols(symbols, example_inputs)
    model_checks.check_module(model, example_inputs)  # what a captured graph would drop
    with quiet_torch_logging():
        watch = capture_errors.Watch()
        with host_random.watch(), constants.watch(model) as reads:  # numpy draws are refused
            returned, output = _check_forward(model, example_inputs, watch)  # by the capture
        try:
            gm, source, notes = capture_both(model, example_inputs, symbols, capture)  # train and eval
        except _Refinable as exc:
            raise CaptureError(_refined(exc, output, watch)) from exc
        if source == "fx":
            fx_tracer.keep_output_class(gm, returned)
        try:
            syms, point, shape_notes = propagate_shapes(gm, example_inputs, symbols)
        except PipeccError:  # a data-dependent node: fixed sizes would not help
            raise
        except Exception as exc:
            if not symbols:
                raise PipeccError(f"shape propagation failed on the captured graph: "
                                  f"{type(exc).__name__}: {_first_line(exc)}") from exc
            # the graph only runs at the example sizes (e.g. export specialised them)
            syms, point, shape_notes = propagate_shapes(gm, example_inputs, [])
            shape_notes.append(f"the captured graph only runs at the example sizes "
                               f"({type(exc).__name__}); costs are numbers, not expressions in "
                               f"{', '.join(s.name for s in symbols)}")
    _check_output(gm)
    model_checks.check_writes(gm)  # a parameter written in place (fx or export form)
    annotate_ops_and_names(gm)
    model_checks.check_dtypes(gm)
    frozen = constants.note(reads)  # Python attributes the graph keeps as constants
    return AnnotatedGraph(gm=gm, symbols=syms, point=point, source=source, model_name=model_name,
                          warnings=notes + shape_notes + ([frozen] if frozen else []))


def check_symbols(symbols: Sequence[SymbolSpec], inputs: tuple) -> None:
    """Every symbol names a dim of a tensor input that exists (UsageError otherwise)."""
    for s in symbols:
        where = f"--symbol {s.name}={'+'.join(map(str, s.inputs))}:{s.dim}"
        for i in s.inputs:
            if not 0 <= i < len(inputs):
                raise UsageError(f"{where}: the model's forward takes {len(inputs)} input"
                                 f"{'s' if len(inputs) != 1 else ''}, so there is no input {i} "
                                 f"(inputs count from 0)")
            x = inputs[i]
            if not isinstance(x, torch.Tensor):
                raise UsageError(f"{where}: input {i} is a {type(x).__name__}, not a tensor")
            if not 0 <= s.dim < x.dim():
                raise UsageError(f"{where}: input {i} has {x.dim()} dims, so there is no dim "
                                 f"{s.dim} (dims count from 0)")


def _check_output(gm: fx.GraphModule) -> None:
    """A pipeline passes tensors between stages and returns the last stage's: a forward that
    returns no tensor (None, a number) has nothing to pipeline."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned: list[fx.Node] = []
    fx.node.map_arg(out.args, returned.append)
    if not any(next(tensors_in(n.meta.get(META_VALUE)), None) is not None for n in returned):
        what = "None" if out.args[0] is None else "no tensor"
        raise PipeccError(f"the model's forward returns {what}; pipecc pipelines a forward that "
                          "returns a tensor (or a tuple, list or dict of tensors)")


_NO_OUTPUT = object()  # the fake forward failed; the real one's output is not kept


def _refined(exc: _Refinable, output: Any, watch: capture_errors.Watch) -> str:
    """`exc`'s line, or one naming the construct: a non-tensor output (a DynamicCache), or a
    Python branch on a torch random draw (layerdrop)."""
    found = capture_errors.foreign_output(output) if output is not _NO_OUTPUT else None
    if found:
        return capture_errors.output_refusal(found)
    site = exc.site or capture_errors.data_dependent_site(exc.export_exc)
    named = capture_errors.random_branch_refusal(site, watch.draws) if site is not None else None
    return named or str(exc)


def _check_forward(model: torch.nn.Module, inputs: tuple,
                   watch: capture_errors.Watch | None = None) -> tuple[type, Any]:
    """Run forward once under fake tensors so a broken model fails with its own error; the
    class of what it returns and the (fake) output itself, or _NO_OUTPUT when only the real
    forward ran. `watch` records the torch random draws of the fake run."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_inputs(mode, inputs, {})
    try:
        with fake_weights(model, mode), shape_safe_batchnorm(model), mode, \
                pywarnings.catch_warnings(), (watch or contextlib.nullcontext()):
            pywarnings.simplefilter("ignore")
            out = model(*fake)
            return type(out), out
    except SystemExit as exc:
        raise PipeccError(f"the model's forward called sys.exit({exc.code!r})") from None
    except Exception as exc:
        fake_exc = exc
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    if not isinstance(fake_exc, (DataDependentOutputException, DynamicOutputShapeException,
                                 GuardOnDataDependentSymNode, NotImplementedError, RuntimeError)):
        raise PipeccError(f"the model's forward raised {type(fake_exc).__name__}: "
                          f"{_first_line(fake_exc)}") from fake_exc
    try:  # data-dependent code needs real values: check for real (and undo what it changes)
        with preserved_state(model, weights=True), torch.no_grad():
            return type(model(*inputs)), _NO_OUTPUT
    except SystemExit as exc:
        raise PipeccError(f"the model's forward called sys.exit({exc.code!r})") from None
    except Exception as exc:
        raise PipeccError(f"the model's forward raised {type(exc).__name__}: {_first_line(exc)}") from exc


def parse_symbols(items: Sequence[str] | None) -> list[SymbolSpec]:
    """`--symbol S=0:1` marks dim 1 of input 0 as the symbol S (inputs may be a+b lists)."""
    out = []
    for item in items or []:
        name, sep, where = item.partition("=")
        inputs, sep2, dim = where.partition(":")
        try:
            assert sep and sep2 and name.isidentifier()
            spec = SymbolSpec(name, tuple(int(i) for i in inputs.split("+")), int(dim))
        except (AssertionError, ValueError):
            raise UsageError(f"--symbol {item!r} is not NAME=INPUT:DIM (example: --symbol S=0:1)") from None
        if name == "B":  # the batch: every input's dim 0 already, split by the runtime
            raise UsageError(f"--symbol {item}: B is the batch symbol pipecc gives every input's dim 0 itself; "
                             "name another dim with another symbol (e.g. --symbol S=0:1)")
        out.append(spec)
    return out

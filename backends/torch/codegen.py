"""Readable, standalone `stage.py` files: one `nn.Module` per pipeline stage, plain torch code.

A generated file imports torch only (plus `math`/`operator` if the graph calls them,
`pipecc.frontend.onnx_ops` for graphs imported from ONNX, whose operators are pipecc functions,
and the library or model-file functions the graph calls as single nodes, imported by module
path: `render.FunctionImports` says how, and the rule for the model file's own). It holds

  * a header docstring: model, stage, device, the nodes it holds, and every received and sent
    port with its dtype and shape (symbolic dims shown, `float32[B, 128]`);
  * `class Stage<i>(torch.nn.Module)`: `__init__` creates empty parameters and buffers (values
    come from `weights.safetensors`, keyed by attribute name) and instantiates the few modules
    kept whole (LSTM, GRU, ...); `forward(self, <received ports>)` is straight-line code, one
    statement per graph node, returning the tuple of sent ports; it starts with
    `x = x.clone()  # mutated in place below: ...` for each received tensor the stage may write
    in place (`inplace.written_inputs`: a received tensor is a leaf of autograd in the
    distributed runtime, which must not be modified in place);
  * class attributes `PARAM_NAMES` (attribute -> qualified name in the original model's
    state_dict, for parameters and buffers), `PARAM_ALIASES` (further names of a tied tensor) and
    `SHARDS` (attribute -> (original name, dim, start, size) for a split layer's weight slice).
  * a stage whose plan entry asks for it (`StagePlan.recompute`) is written with the forward
    wrapper a technique's codegen part gives (its hook `forward_wrapper(planned)`; recomputation's:
    its straight-line code in `stage_forward`, and `forward` runs it under
    `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`). A forward wrapper gives
    `body` (the straight-line code's method name, kept free), `imports` (lines after torch's),
    `header` (lines of the header docstring) and `forward(signature, arg_names)` (the class's
    `forward`, which calls `body`).

Every identifier is derived through `names.Identifiers`; untrusted names appear only inside
string literals (`ascii()`) and escaped comment/docstring text (see `names.py`).
"""

from __future__ import annotations

import json
import operator
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pipecc.backends.torch import lower_modules, render
from pipecc.techniques import first_answer
from pipecc.backends.torch.inplace import written_inputs
from pipecc.backends.torch.names import RESERVED, Identifiers, is_plain_identifier, literal, text
from pipecc.backends.torch.stages import Port, Stage, ports_json
from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME, META_OP, META_VALUE, ScalarInfo, TensorInfo, tensors_in
from pipecc.ir.plan import StagePlan
from pipecc.runtime.local import load_stage  # noqa: F401  (re-exported: the loader lives in the runtime)


@dataclass
class GeneratedStage:
    """A stage's source text and the tensors its `weights.safetensors` must hold."""

    class_name: str
    source: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # state key -> tensor or slice


def emit_stage_source(stage: Stage, model_name: str, stage_index: int | None = None,
                      device_desc: str = "cpu", num_stages: int | None = None,
                      recompute: bool = False) -> str:
    """The text of `stage.py` for `stage` (see the module docstring)."""
    return generate_stage(stage, model_name, stage_index, device_desc, num_stages, recompute).source


def generate_stage(stage: Stage, model_name: str, stage_index: int | None = None,
                   device_desc: str = "cpu", num_stages: int | None = None,
                   recompute: bool = False, class_name: str | None = None) -> GeneratedStage:
    """The source and tensors of a stage's module, class `Stage<index>` unless `class_name`
    (a Bi-Partition segment is a `Segment<boundary>`, `techniques.bipartition.codegen`)."""
    index = stage.index if stage_index is None else stage_index
    emitter = _Emitter(stage, first_answer("codegen", "forward_wrapper", written_as(int(index), recompute)))
    emitter.run()
    cls = class_name or f"Stage{int(index)}"
    header = _header(stage, emitter, model_name, index, device_desc, num_stages, title=class_name)
    return GeneratedStage(cls, emitter.assemble(cls, header), emitter.tensors)


def written_as(index: int, recompute: bool = False) -> StagePlan:
    """The plan entry the techniques' hooks read for stage `index` (`forward_wrapper`,
    `wrap_module`): the flags its code depends on (`StagePlan.recompute`), nothing else."""
    return StagePlan(index=index, device=-1, nodes=[], recompute=recompute)


def save_weights(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' `save_file`, whose I/O failures (a full disk) are a `SafetensorError`, not
    an OSError: raised here as the OSError they are, with the errno the message names, so the
    compile's writer reports them in one line and removes its temporary folder."""
    import errno
    import re

    from safetensors import SafetensorError
    from safetensors.torch import save_file
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        text = str(exc)
        code = re.search(r"os error (\d+)", text)
        number = int(code.group(1)) if code else errno.EIO
        raise OSError(number, os.strerror(number) if code else text, str(path)) from exc


def write_stage(out_dir: str | Path, stage: Stage, *, model_name: str, num_stages: int,
                device_desc: str = "cpu", recompute: bool = False) -> Path:
    """Write `stage.py`, `weights.safetensors` and `ports.json` into `out_dir` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = generate_stage(stage, model_name, stage.index, device_desc, num_stages, recompute)
    (out / "stage.py").write_text(gen.source, encoding="utf-8")
    tensors = {k: t.detach().to("cpu").contiguous().clone() for k, t in gen.tensors.items()}
    save_weights(tensors, out / "weights.safetensors", {"format": "pt", "pipecc.stage": str(stage.index)})
    ports = dict(ports_json(stage, num_stages), **{"class": gen.class_name})
    (out / "ports.json").write_text(json.dumps(ports, indent=1), encoding="utf-8")
    return out


# ----------------------------------------------------------------------------- emitter
class _Emitter:
    """Walks the stage graph once, collecting `__init__` lines, forward lines and tensors."""

    def __init__(self, stage: Stage, wrapper: Any = None) -> None:
        self.stage = stage
        self.wrapper = wrapper  # the forward wrapper, or None (module docstring)
        self.attrs = Identifiers(set(dir(nn.Module)) | RESERVED | ({self.wrapper.body} if self.wrapper else set()))
        self.locals = Identifiers(set(RESERVED))
        self.init: list[str] = []
        self.body: list[str] = []
        self.args: list[str] = []               # forward's parameters, with annotations
        self.arg_names: list[str] = []          # their names, in `receives` order
        self.return_names: list[str] = []       # the returned variables, in `sends` order
        self.param_names: dict[str, str] = {}
        self.aliases: dict[str, tuple[str, ...]] = {}
        self.shards: dict[str, tuple[str, int, int, int]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.imports: set[str] = set()
        # functions of other modules (a library's torch.fx.wrap'ed ones, the model file's):
        # module-level aliases, taken from the locals' names so that none shadows another
        self.functions = render.FunctionImports(lambda hint: self.locals.fresh(hint, "fn"))
        self._attr_of: dict[Any, str] = {}     # id(tensor) or slice key -> attribute
        self._modules: dict[int, str] = {}     # id(instantiated module) -> attribute
        self._var: dict[fx.Node, str] = {}
        self._target = ""                      # qualified target of the node being lowered
        self._op = ""                          # and its op (leads a digit-only name: linear_0)

    # -- the Context protocol of lower_modules
    def const(self, value: Any) -> str:
        return render.constant(value, self._node_expr)

    def statement(self, line: str) -> None:
        self.body.extend(line.splitlines())

    def temp(self, hint: str) -> str:
        return self.locals.fresh(hint)

    def tensor(self, t: torch.Tensor | None, hint: str) -> str:
        """`self.<attr>` for a parameter, buffer or weight slice, declared on first use."""
        if t is None:
            return "None"
        qualified = f"{self._target}.{hint}" if self._target else hint
        base = t._base if not isinstance(t, nn.Parameter) else None
        if base is not None and id(base) in self.stage.tensor_names and base.shape != t.shape:
            return self._slice(t, base, qualified)
        if base is not None and id(base) in self.stage.tensor_names:
            t = base  # a view of the whole tensor (a shard's bias) is the tensor itself
        if id(t) in self._attr_of:
            return f"self.{self._attr_of[id(t)]}"
        names = self.stage.tensor_names.get(id(t), (qualified,))
        attr = self.attrs.fresh(names[0], self._prefix(names[0]))
        self._declare(attr, t, names)
        return f"self.{attr}"

    def _declare(self, attr: str, t: torch.Tensor, names: tuple[str, ...]) -> None:
        self._attr_of[id(t)] = attr
        self.tensors[attr] = t
        self.param_names[attr] = names[0]
        if len(names) > 1:
            self.aliases[attr] = names[1:]
        empty = f"torch.empty({self.const(tuple(t.shape))}, dtype={self.const(t.dtype)})"
        if isinstance(t, nn.Parameter):
            grad = "" if t.requires_grad else ", requires_grad=False"
            self.init.append(f"self.{attr} = torch.nn.Parameter({empty}{grad})")
        else:
            persistent = id(t) in self.stage.tensor_names and id(t) not in self.stage.nonpersistent
            flag = "" if persistent else ", persistent=False"
            self.init.append(f"self.register_buffer({literal(attr)}, {empty}{flag})")

    def _slice(self, view: torch.Tensor, base: torch.Tensor, qualified: str) -> str:
        """A split layer's weight slice: a parameter of its own, recorded in SHARDS."""
        dims = [d for d in range(base.dim()) if view.shape[d] != base.shape[d]]
        if len(dims) != 1 or view.stride() != base.stride():
            raise PipeccError(f"{qualified}: a weight view that is not one narrow() of its parameter")
        dim = dims[0]
        start = (view.storage_offset() - base.storage_offset()) // base.stride(dim)
        key = (id(base), dim, start, view.shape[dim])
        if key not in self._attr_of:
            attr = self.attrs.fresh(qualified, self._prefix(qualified))
            self._attr_of[key] = attr
            self.tensors[attr] = view
            self.shards[attr] = (self.stage.tensor_names[id(base)][0], dim, start, view.shape[dim])
            empty = f"torch.empty({self.const(tuple(view.shape))}, dtype={self.const(view.dtype)})"
            self.init.append(f"self.{attr} = torch.nn.Parameter({empty})")
        return f"self.{self._attr_of[key]}"

    def _prefix(self, qualified: str) -> str:
        """What leads a digit-only attribute name: the op of the module owning the tensor."""
        owned = self._target and qualified.startswith(f"{self._target}.")
        return self._op if owned and self._op else "param"

    def _instantiate(self, module: nn.Module, target: str) -> str:
        """A module kept whole: built in __init__, its tensors named by the module."""
        if id(module) not in self._modules:
            attr = self.attrs.fresh(target, self._op or "module")
            self.init.append(f"self.{attr} = {lower_modules.constructor(module, self.const)}")
            for kind, items in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
                for name, t in items:
                    key = f"{attr}.{name}"
                    names = self.stage.tensor_names.get(id(t), (f"{target}.{name}",))
                    self._attr_of[id(t)], self.tensors[key], self.param_names[key] = key, t, names[0]
                    if len(names) > 1:
                        self.aliases[key] = names[1:]
            self._modules[id(module)] = attr
        return f"self.{self._modules[id(module)]}"

    # -- the walk
    def _node_expr(self, node: Any) -> str:
        return self._var[node]

    def run(self) -> None:
        receives = iter(self.stage.receives)
        # inputs some op writes in place: work on a copy (see `inplace`); a module with a
        # lowering rule is written out of place (F.relu for nn.ReLU(inplace=True))
        written = set(written_inputs(self.stage.gm, _kept_in_place))
        last_reader = {a: n for n in self.stage.gm.graph.nodes for a in n.all_input_nodes}
        for node in self.stage.gm.graph.nodes:
            if node.op == "placeholder":
                port = next(receives)  # a model input keeps its argument name, a value its producer's
                self._var[node] = self.locals.fresh(port.name, "input") if port.stage < 0 \
                    else self._local(node)
                hint = ": torch.Tensor" if isinstance(port.value, TensorInfo) else ""
                self.args.append(f"{self._var[node]}{hint}")
                self.arg_names.append(self._var[node])
                if len(self.arg_names) - 1 in written:  # this placeholder's position
                    self.body.append(_clone(self._var[node], port))
            elif node.op == "get_attr":
                self._var[node] = self._get_attr(node)
            elif node.op == "output":
                self.return_names = [self._var[n] for n in node.args[0]]
                self.body.append(f"return {render.constant(tuple(node.args[0]), self._node_expr)}")
            else:
                expr = self._expression(node)
                var = self._local(node)
                self._var[node] = var
                self.body.append(f"{var} = {expr}{_comment(node)}")
                # values no later line reads are released at once, as the plan's memory counts them
                # (a name kept to the return would hold every transient of the forward)
                done = [a for a in node.all_input_nodes
                        if last_reader[a] is node and a.op in ("call_function", "call_module", "call_method")]
                done += [node] if node not in last_reader else []
                done = [a for a in done if any(True for _ in tensors_in(a.meta.get(META_VALUE)))]
                if done:
                    self.body.append(f"del {', '.join(self._var[a] for a in done)}")

    def _local(self, node: fx.Node) -> str:
        """The variable holding `node`'s value, named after its human name (`blocks.0.add` ->
        `blocks_0_add`, `0` -> `linear_0`); a value received from an earlier stage has the
        producer's meta, hence the name it has there."""
        return self.locals.fresh(node.meta.get(META_NAME, node.name), node.meta.get(META_OP, node.op))

    def _get_attr(self, node: fx.Node) -> str:
        obj: Any = self.stage.gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.Tensor):
            raise PipeccError(f"get_attr {text(node.target)}: a {type(obj).__name__}, not a tensor")
        self._target, self._op = "", ""
        return self.tensor(obj, str(node.target))

    def _expression(self, node: fx.Node) -> str:
        args = [self.const(a) for a in node.args]
        kwargs = _kwargs(node.kwargs, self.const)
        if node.op == "call_module":
            module = self.stage.gm.get_submodule(str(node.target))
            self._target, self._op = str(node.target), str(node.meta.get(META_OP, ""))
            rule = lower_modules.rule_for(module)
            if rule is not None and len(node.args) == 1 and not node.kwargs:
                return rule(module, self, args[0])
            return f"{self._instantiate(module, str(node.target))}({', '.join(args + kwargs)})"
        if node.op == "call_method":
            method, receiver = node.target, render.atom(args[0])
            call = f"{receiver}.{method}" if is_plain_identifier(method) \
                else f"getattr({args[0]}, {literal(method)})"
            return f"{call}({', '.join(args[1:] + kwargs)})"
        return self._function(node, args, kwargs)

    def _function(self, node: fx.Node, args: list[str], kwargs: list[str]) -> str:
        fn = node.target
        if fn in render.BINARY and len(args) == 2 and not kwargs:
            return f"{render.atom(args[0])} {render.BINARY[fn]} {render.atom(args[1])}"
        if fn in render.UNARY and len(args) == 1 and not kwargs:
            return f"{render.UNARY[fn]}{render.atom(args[0])}"
        if fn is operator.getitem and len(args) == 2:
            return f"{render.atom(args[0])}[{render.subscript(node.args[1], self._node_expr)}]"
        if fn is getattr and len(node.args) == 2 and is_plain_identifier(node.args[1]):
            return f"{render.atom(args[0])}.{node.args[1]}"
        return f"{render.callable_name(fn, self.imports, self.functions)}({', '.join(args + kwargs)})"

    # -- assembly
    def assemble(self, cls: str, header: str) -> str:
        lines = [header, "", "import torch", "import torch.nn.functional as F"]
        lines += list(self.wrapper.imports) if self.wrapper else []
        lines += [f"import {m}" for m in sorted(self.imports - {"onnx_ops"})]
        if "onnx_ops" in self.imports:
            lines.append("from pipecc.frontend import onnx_ops  # torch implementations of ONNX operators")
        lines += self.functions.header()
        lines += ["", "", f"class {cls}(torch.nn.Module):"]
        lines += _mapping("PARAM_NAMES", self.param_names, always=True)
        lines += _mapping("PARAM_ALIASES", self.aliases) + _mapping("SHARDS", self.shards)
        lines += ["", "    def __init__(self) -> None:", "        super().__init__()"]
        lines += [f"        {line}" for line in self.init]
        signature = ', '.join(['self'] + self.args)
        if self.wrapper:
            lines += ["", *self.wrapper.forward(signature, self.arg_names)]
        lines += ["", f"    def {self.wrapper.body if self.wrapper else 'forward'}({signature}) -> tuple:"]
        lines += [f"        {line}" for line in self.body]
        return "\n".join(lines) + "\n"


def _clone(var: str, port: Port) -> str:
    """A written input's copy: the received tensor is a leaf autograd must not see modified."""
    why = "the received tensor is a leaf" if port.stage >= 0 else "the caller's input stays as it is"
    return f"{var} = {var}.clone()  # mutated in place below: {why}"


def _kept_in_place(module: nn.Module) -> bool:
    """Whether the generated code runs `module` in place: an `inplace` module kept whole."""
    return getattr(module, "inplace", False) is True and lower_modules.rule_for(module) is None


def _kwargs(kwargs: dict[str, Any], const: Any) -> list[str]:
    plain = [f"{k}={const(v)}" for k, v in kwargs.items() if is_plain_identifier(k)]
    odd = {k: v for k, v in kwargs.items() if not is_plain_identifier(k)}
    return plain + ([f"**{const(odd)}"] if odd else [])


def _mapping(name: str, items: dict[str, Any], always: bool = False) -> list[str]:
    if not items:
        return [f"    {name}: dict = {{}}"] if always else []
    body = [f"        {literal(k)}: {_literal(v)}," for k, v in items.items()]
    return [f"    {name} = {{", *body, "    }"]


def _literal(value: Any) -> str:
    if isinstance(value, tuple):
        return f"({', '.join(_literal(v) for v in value)}{',' if len(value) == 1 else ''})"
    return literal(value) if isinstance(value, str) else repr(int(value))


def _comment(node: fx.Node) -> str:
    value = node.meta.get(META_VALUE)
    shape = f" {_describe(value)}" if isinstance(value, TensorInfo) else ""
    return f"  # {text(node.meta.get(META_NAME, node.name))}{shape}"


def _describe(value: Any) -> str:
    if isinstance(value, TensorInfo):
        return text(value.describe())
    if isinstance(value, ScalarInfo):
        return f"object {text(value.value)}" if value.value is not None else "object"
    if isinstance(value, (tuple, list)):
        return f"tuple({', '.join(_describe(v) for v in value)})"
    return "None"


def _port_line(code_name: str, port: Port, where: str) -> str:
    """`name: dtype[shape]  (producer; where)`; the port's own name when the code's differs."""
    renamed = "" if code_name == port.name else f"port {text(port.name)}; "
    return f"    {code_name}: {_describe(port.value)}  ({renamed}{text(port.producer)}; {where})"


def _header(stage: Stage, emitter: _Emitter, model_name: str, index: int, device_desc: str,
            num_stages: int | None, title: str | None = None) -> str:
    of = f" of {num_stages}" if num_stages is not None else ""
    nodes = ", ".join(text(n) for n in stage.nodes) or "(none: this stage only relays values)"
    what = text(title) if title else f"Stage {int(index)}{of}"
    lines = [f'"""{what} of model {text(model_name)}, generated by pipecc: edit the '
             "model, not this file.", "", f"Device: {text(device_desc)}",
             *textwrap.wrap(f"Nodes ({len(stage.nodes)}): {nodes}", 96, subsequent_indent="    ",
                            break_on_hyphens=False),
             "", "Receives (forward's arguments, in order):"]
    lines += [_port_line(a, p, "model input" if p.stage < 0 else f"computed by stage {p.stage}")
              for a, p in zip(emitter.arg_names, stage.receives)] or ["    (nothing)"]
    lines += ["Sends (forward's returned tuple, in order):"]
    to = "model output" if num_stages is not None and index == num_stages - 1 else "to the next stage"
    lines += [_port_line(v, p, to) for v, p in zip(emitter.return_names, stage.sends)] or ["    (nothing)"]
    if stage.tied:
        lines += ["", "Tied weights (other stages use them too; sum their gradients across stages):",
                  *textwrap.wrap(", ".join(text(t) for t in stage.tied), 92,
                                 initial_indent="    ", subsequent_indent="    ")]
    if any(line.startswith("del ") for line in emitter.body):
        lines += ["", "`del` lines release values no later line reads (what autograd keeps stays), as the",
                  "plan's peak memory counts them."]
    if emitter.wrapper:
        lines += list(emitter.wrapper.header)
    lines += ["", "Weights: weights.safetensors beside this file, keyed by attribute name. PARAM_NAMES",
              "maps each attribute to its name in the original model's state_dict.", '"""']
    return "\n".join(lines)

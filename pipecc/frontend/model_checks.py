"""What a model must be for its pipeline to train it as the model would train, checked at
compile time so that it is refused in one line there, not accepted and broken in a rank later.

* `check_module` (before capture): what a captured graph drops or cannot carry. Forward hooks
  and pre-hooks (also `torch.nn.utils.spectral_norm`'s, which is one) run in `nn.Module.__call__`
  and the generated stages call the layers' functions, not the modules: they would be dropped.
  A parametrized weight whose parametrization keeps state (`orthogonal`'s `base`, the new
  `spectral_norm`'s power-iteration vectors, updated in forward) is refused: the stages hold
  the originals the graph computes the weight from, not that state. A stateless one
  (`weight_norm`, as Wav2Vec2's positional convolution has) is captured as ops on its
  originals, which the stages train as the model does. Sparse tensors have no safetensors form nor a wire format. A NaN or Inf
  in a weight or a floating example input makes every loss NaN: refused, not warned, because
  `pipecc run` trains on exactly those inputs and `--verify` cannot compare NaN with NaN.
* `check_writes` (the captured graph): an in-place write to a parameter in forward
  (`self.w.add_(...)`, `self.w.data.mul_(...)`): every stage holds its own copy of its
  parameters and the optimizer owns their values, so the write cannot be carried.
* `check_loss` (the model file's `loss_fn` and `example_target`, on fake tensors: no FLOPs):
  the loss must be a one-element floating tensor of the outputs and the target, and a tensor
  target must have the batch as dim 0 (the runtime splits it along dim 0 like the inputs).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings as pywarnings
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn

from pipecc.errors import PipeccError
from pipecc.runtime.loss_reduction import MEAN_LOSS, LossReduction, analyse

_HOOKS = (("_forward_hooks", "forward hook"), ("_forward_pre_hooks", "forward pre-hook"),
          ("_backward_hooks", "backward hook"), ("_backward_pre_hooks", "backward pre-hook"))


def _hook_name(hook: Any) -> str:
    cls = type(hook).__name__
    if cls in ("SpectralNorm", "WeightNorm"):
        return f"torch.nn.utils.{'spectral_norm' if cls == 'SpectralNorm' else 'weight_norm'}"
    return getattr(hook, "__qualname__", None) or cls


def _global_hooks() -> list[str]:
    from torch.nn.modules import module as mod
    found = []
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(mod, attr, None):
            found.append(attr.removeprefix("_global_").replace("_", " ").replace("pre hooks", "pre-hooks"))
    return found


def _check_call_and_signature(model: nn.Module) -> None:
    """What the compiled pipeline would silently skip or cannot feed: a model class that overrides
    ``__call__`` (the capture runs its forward, so the extra work would be dropped), and
    ``forward(*args)`` (stage 0's inputs are named by forward's parameters)."""
    import inspect
    # NOTE: the model only: capture calls a submodule through its __call__ (an override is traced
    # like forward), but the model itself through forward
    own = next((k for k in type(model).__mro__ if "__call__" in vars(k)), nn.Module)
    if own is not nn.Module and issubclass(own, nn.Module) and own.__module__.split(".")[0] != "torch":
        raise PipeccError(f"the model ({type(model).__name__}) overrides __call__, which the compiled pipeline never "
                          "calls (it runs forward's operations): move that work into forward")
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        raise PipeccError(f"{type(model).__name__}.forward takes *args; pipecc names the pipeline's inputs by "
                          "forward's parameters: give them names (def forward(self, x, mask=None))")


def check_module(model: nn.Module, inputs: tuple) -> None:
    """Refuse hooks, parametrizations, sparse tensors and non-finite weights or inputs (module
    docstring: why each)."""
    from torch.nn.utils import parametrize
    glob = _global_hooks()
    if glob:
        raise PipeccError(f"global module {glob[0]} are registered (torch.nn.modules.module."
                          "register_module_*_hook); the compiled stages do not run hooks: remove them "
                          "before compiling")
    _check_call_and_signature(model)
    for name, module in model.named_modules():
        where = f"module '{name}'" if name else "the model"
        if parametrize.is_parametrized(module):
            stateful = sorted({type(p).__name__ for plist in module.parametrizations.values() for p in plist
                               if any(True for _ in p.buffers())})
            if stateful:
                tensors = ", ".join(module.parametrizations.keys())
                raise PipeccError(f"{where} has a parametrized {tensors} ({', '.join(stateful)}) whose "
                                  "parametrization keeps state the stages would not hold: call "
                                  "torch.nn.utils.parametrize.remove_parametrizations before compiling "
                                  "(the weight then trains freely), or write the parametrization in forward")
        for attr, what in _HOOKS:
            hooks = getattr(module, attr, None)
            if hooks:
                hook = _hook_name(next(iter(hooks.values())))
                raise PipeccError(f"{where} has a {what} ({hook}); the compiled stages call the layers, "
                                  "not their hooks, so it would be dropped: remove it, or write what it "
                                  "does in the model's forward")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            # NOTE: a buffer may hold +-Inf by design (an additive -inf attention mask, as
            # nn.Transformer.generate_square_subsequent_mask makes); only NaN is refused there
            _check_tensor(t, f"{kind} '{name}'", "set it to finite values before compiling",
                          inf_ok=kind == "buffer")
    for i, x in enumerate(_tensors(inputs)):
        _check_tensor(x, f"example input {i}", "example_inputs must return finite values")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _check_tensor(t: torch.Tensor, what: str, fix: str, *, inf_ok: bool = False) -> None:
    if t.layout != torch.strided:
        raise PipeccError(f"{what} is a {str(t.layout).removeprefix('torch.')} tensor; pipecc pipelines "
                          "dense tensors only (stages save and send them as such): make it dense "
                          "with .to_dense()")
    if t.device.type == "meta" or not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return
    with torch.no_grad():
        finite = not bool(torch.isnan(t).any()) if inf_ok else bool(torch.isfinite(t).all())
    if not finite:
        bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
        raise PipeccError(f"{what} holds {bad}; every loss would be NaN and --verify could not compare "
                          f"the pipeline with the model: {fix}")


_INPLACE_SKIP = {"__iadd__", "__imul__"}  # python operators on tensors arrive as add_/mul_ anyway


def _inplace(node: fx.Node) -> str | None:
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if hasattr(node.target, "_schema"):  # an aten overload: aten.add_.Tensor
            name = node.target._schema.name.split("::")[-1]
    else:
        return None
    return name if name.endswith("_") and not name.endswith("__") and name not in _INPLACE_SKIP else None


def _param_of(node: Any, params: set[str]) -> str | None:
    """The parameter `node` is (a get_attr of it, or its .data / .detach() view)."""
    while isinstance(node, fx.Node):
        if node.op == "get_attr":
            return str(node.target) if str(node.target) in params else None
        if node.op == "call_function" and node.target is getattr and node.args[1:] == ("data",):
            node = node.args[0]
        elif node.op == "call_method" and node.target in ("detach", "view_as"):
            node = node.args[0]
        else:
            return None
    return None


def check_writes(gm: fx.GraphModule) -> None:
    """Refuse a forward that writes one of its parameters in place (module docstring): an
    in-place op on the parameter in a torch.fx graph, or torch.export's write-back of a mutated
    parameter (`pipecc.frontend.regions.parameter_write`)."""
    from pipecc.frontend import regions
    params = {name for name, _ in gm.named_parameters()}
    written, op = None, None
    for node in gm.graph.nodes:
        op = _inplace(node)
        if op is None or not node.args:
            continue
        written = _param_of(node.args[0], params)
        if written is not None:
            break
    if written is None:
        written, op = regions.parameter_write(gm), None
    if written is not None:
        how = f" ({op})" if op else ""
        raise PipeccError(f"the model's forward writes parameter '{written}' in place{how}; each stage holds "
                          "its own copy of its parameters and the optimizer owns their values: compute a "
                          "new tensor instead (w = w * s) or make it a buffer")


_MIXED_DTYPE_KINDS = ("linear", "matmul", "conv", "conv_transpose")


def check_dtypes(gm: fx.GraphModule) -> None:
    """Refuse a linear, conv or matmul node that multiplies an integer tensor with a floating one:
    torch raises for it at run time ("mat1 and mat2 must have the same dtype"), but fake tensors,
    which the analysis runs on, do not check it. (Attention takes boolean or integer masks, an
    RNN integer lengths: not checked.)"""
    from pipecc.ir.graph import META_KIND, META_NAME, META_PARAMS, META_VALUE, TensorInfo
    for node in gm.graph.nodes:
        if node.meta.get(META_KIND) not in _MIXED_DTYPE_KINDS:
            continue
        # NOTE: a grouped (expert) matmul takes its groups' integer offsets as its last operand
        operands = node.all_input_nodes[:2] if "grouped_mm" in str(node.target) else node.all_input_nodes
        infos = [a.meta.get(META_VALUE) for a in operands]
        infos += [info for _, info in node.meta.get(META_PARAMS) or ()]
        infos = [i for i in infos if isinstance(i, TensorInfo)]
        ints = [i for i in infos if not (i.dtype.is_floating_point or i.dtype.is_complex or i.dtype == torch.bool)]
        floats = [i for i in infos if i.dtype.is_floating_point or i.dtype.is_complex]
        if ints and floats:
            raise PipeccError(f"node {node.meta.get(META_NAME, node.name)} ({node.meta[META_KIND]}) takes a "
                              f"{ints[0].describe()} with {floats[0].describe()}; torch refuses that when it runs "
                              "(the dtypes must match): convert the input with .float() (or embed token ids)")


def check_loss(model: nn.Module, inputs: tuple, batch: int, loss_fn: Callable | None,
               make_target: Callable[[int], Any] | None, file: str) -> LossReduction:
    """The model file's loss_fn and example_target, on fake tensors (module docstring), and how
    its micro-batch losses combine (`pipecc.runtime.loss_reduction.analyse`: a mean, a sum, or
    mixed). A model fake tensors cannot run (data-dependent code) is left to the capture's own
    check (and its loss counted a mean, as the runtime always did)."""
    if make_target is None and loss_fn is None:
        return MEAN_LOSS
    target = None
    if make_target is not None:
        try:
            target = make_target(batch)
        except SystemExit as exc:
            raise PipeccError(f"example_target in {file} called sys.exit({exc.code!r})") from None
        except Exception as exc:
            raise PipeccError(f"example_target in {file} failed: {type(exc).__name__}: {exc}") from exc
        for t in _tensors(target):
            if t.dim() == 0 or t.shape[0] != batch:
                raise PipeccError(f"example_target({batch}) in {file} returned a tensor of shape "
                                  f"{list(t.shape)}; the runtime splits the target along dim 0 like the "
                                  f"batch, so dim 0 must be the batch size {batch}")
            _check_tensor(t, f"example_target's tensor of shape {list(t.shape)}", "make it finite")
    if not callable(loss_fn) or target is None:
        return MEAN_LOSS
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipecc.frontend.model_state import fake_weights, preserved_state
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    with preserved_state(model), pywarnings.catch_warnings(), _quiet_fake_tensors():
        pywarnings.simplefilter("ignore")
        try:
            with fake_weights(model, mode), mode:
                outputs = model(*fake_inputs)
        except Exception:
            return MEAN_LOSS  # the capture reports a forward that fails; one fake tensors cannot run is fine
        fake_target = _fake_tree(target, mode)
        try:
            with mode:
                loss = loss_fn(outputs, fake_target)
        except SystemExit as exc:
            raise PipeccError(f"loss_fn in {file} called sys.exit({exc.code!r})") from None
        except Exception as exc:
            if _unsupported_by_fake(exc):
                return analyse(loss_fn, outputs, target, batch)
            # a loss may read values (.tolist(), numpy) that fake tensors lack: on real zeros
            # of the outputs' shapes it either runs (fake tensors' limit) or fails for real
            try:
                loss = loss_fn(_real_tree(outputs), target)
            except SystemExit as exit_exc:
                raise PipeccError(f"loss_fn in {file} called sys.exit({exit_exc.code!r})") from None
            except Exception:
                raise PipeccError(f"loss_fn in {file} raised {type(exc).__name__} on the model's outputs "
                                  f"({_shapes(outputs)}) and example_target ({_shapes(target)}): "
                                  f"{_first_line(exc)}") from None
    if not isinstance(loss, torch.Tensor):
        raise PipeccError(f"loss_fn in {file} returned a {type(loss).__name__}, not a tensor; the loss "
                          "must be a one-element tensor computed from the outputs, so it can be "
                          "back-propagated")
    if loss.numel() != 1:
        raise PipeccError(f"loss_fn in {file} returned a tensor of shape {list(loss.shape)}, not one "
                          "value; reduce it (.mean() or .sum()) so it can be back-propagated")
    if not loss.is_floating_point():
        raise PipeccError(f"loss_fn in {file} returned a {str(loss.dtype).removeprefix('torch.')} tensor; "
                          "the loss must be floating point to be back-propagated")
    return analyse(loss_fn, outputs, target, batch)


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """Fake tensors log an op that fails on them with its whole traceback (torch's logger, at
    ERROR): the loss check turns that failure into one line of its own, so the log is muted."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fake_tree(value: Any, mode: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    if isinstance(value, dict):
        return type(value)((k, _fake_tree(v, mode)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return type(value)(_fake_tree(v, mode) for v in value)
    return value


def _real_tree(value: Any) -> Any:
    """Real zero tensors in place of the fake ones (same shapes and dtypes)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, dict):
        return type(value)((k, _real_tree(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return type(value)(_real_tree(v) for v in value)
    return value


def _unsupported_by_fake(exc: BaseException) -> bool:
    """A loss that reads values (`.item()`, data-dependent shapes) cannot run on fake tensors:
    not the user's error; it is left unchecked here."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    return isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException,
                            GuardOnDataDependentSymNode, NotImplementedError))


def _shapes(value: Any) -> str:
    shapes = [str(list(t.shape)) for t in _tensors(value)]
    return "shape " + ", ".join(shapes[:3]) if shapes else type(value).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.split("\n")[0].strip() if text else type(exc).__name__


__all__ = ["check_dtypes", "check_loss", "check_module", "check_writes"]


_DTYPE_ERROR = re.compile(r"same dtype|scalar type|dtype.*(?:should|must) (?:be|match)|Input type \(\w+\) and "
                          r"(?:weight|bias) type|expected .*dtype|found dtype", re.IGNORECASE)


OUTPUT_GRAD_META = "pipecc.output_grad"  # graph.gm.meta: whether an output carries a gradient (check_forward)


def check_trains(meta: dict[str, Any], schedule: str, trainable: bool) -> None:
    """Refuse a training plan (one line) of a model with no trainable parameters (``trainable``)
    or whose outputs carry no gradient (``check_forward``, in ``meta``)."""
    if schedule != "inference" and not trainable:
        raise PipeccError("the model has no trainable parameters, so a training pipeline has nothing to train "
                          "(`pipecc run` would fail): compile it with --inference for a forward-only pipeline")
    if schedule != "inference" and meta.get(OUTPUT_GRAD_META) is False:
        raise PipeccError("no output of the model carries a gradient (integer outputs such as argmax, or detached "
                          "ones), so a training pipeline has nothing to back-propagate (`pipecc run` would fail): "
                          "return the floating outputs the loss is computed from, or compile with --inference")


def check_forward(model: nn.Module, inputs: tuple, file: str) -> bool | None:
    """The forward on fake tensors of ``example_inputs`` (a capture may infer dtypes without
    running it): an input of another dtype than the weights it meets (float64 inputs into a
    float32 model) is refused in one line here, not at the first step of a run. Returns whether
    a floating output carries a gradient (None: fake tensors cannot run this forward; the
    capture's own checks stand)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipecc.frontend.model_state import fake_weights, preserved_state
    weights = {p.dtype for p in model.parameters() if p.is_floating_point()}
    given = {x.dtype for x in _tensors(inputs) if x.is_floating_point()}
    if weights and given - weights:  # NOTE: fake tensors let a matmul of two dtypes pass: one sample for real
        with preserved_state(model), pywarnings.catch_warnings(), torch.no_grad():
            pywarnings.simplefilter("ignore")
            try:
                model(*(x[:1] if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs))
            except Exception as exc:
                _refuse_dtypes(exc, inputs, file)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    with preserved_state(model), pywarnings.catch_warnings(), _quiet_fake_tensors():
        pywarnings.simplefilter("ignore")
        try:
            with fake_weights(model, mode), mode, torch.enable_grad():
                outputs = model(*fake_inputs)
        except Exception as exc:
            _refuse_dtypes(exc, inputs, file)
            return None
    found = list(_tensors(outputs))
    return any(t.requires_grad for t in found) if found else None


def _refuse_dtypes(exc: Exception, inputs: tuple, file: str) -> None:
    """A forward's failure that is a dtype mismatch, refused in one line (others: returns)."""
    if isinstance(exc, RuntimeError) and _DTYPE_ERROR.search(str(exc)):
        dtypes = sorted({str(x.dtype).removeprefix("torch.") for x in _tensors(inputs) if x.is_floating_point()})
        raise PipeccError(f"the forward of {file}'s model fails on example_inputs ({', '.join(dtypes)}): "
                          f"{_first_line(exc)}; give example_inputs the dtype the model computes in "
                          "(e.g. .float()), or convert the model (.double())") from None

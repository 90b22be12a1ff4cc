"""Loading compiled stages: `OUT/stage_<i>/{stage.py, weights.safetensors, ports.json}`.

`load_stage` imports a generated `stage.py` by path, builds its module and fills it from the
safetensors file (no pickle anywhere). `assemble_owner` gathers the tensors of all stages of one
model under their original qualified names (each generated class maps attribute -> name in
`PARAM_NAMES`), so a `PipelinedModule` over loaded stages has the original `state_dict()` keys:

  * a tied weight (the same name in two stages) becomes one tensor that both stages share;
  * a split layer's slices (`SHARDS`, one per stage holding a shard) are concatenated back into
    the full parameter; each shard then reads its slice of it on every call (a forward pre-hook
    sets the attribute to `full.narrow(dim, start, size)` on the stage's device), so gradients
    and optimizer steps act on the one full parameter.

`check_folder` (`pipecc.runtime.folder_check`, torch-free) checks a folder before a run without executing any of its code (a compiled folder
is code, like a pickle: `stage.py` runs when a stage loads; only run folders you trust).

A technique's stage module around the generated one (a Bi-Partition worker's core and segments)
is its runtime part's ``load_stage`` (``pipecc.runtime.handlers``' loader hooks).

This module imports torch, safetensors, `pipecc.errors`, `pipecc.runtime` and the techniques'
runtime parts only — never the compiler.
"""

from __future__ import annotations

import json
import sys
import types
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from pipecc.errors import PipeccError
# a folder checked without running its code, or torch (`pipecc run`'s launcher): re-exported here
from pipecc.runtime.folder_check import RECOMPILE, check_folder, check_weights_file, gist  # noqa: F401
from pipecc.runtime.folder import read_checked
from pipecc.techniques import first_answer



def load_stage(stage_dir: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """(module, ports) from a compiled stage folder; the module's weights are the saved ones."""
    folder = Path(stage_dir)
    try:
        ports = json.loads(read_checked(folder / "ports.json").decode("utf-8"))
    except ValueError as exc:
        raise PipeccError(f"{folder}: cannot read ports.json ({exc}); is this a pipecc stage folder?") from None
    if not isinstance(ports, dict):
        raise PipeccError(f"{folder / 'ports.json'} is not a port spec; {RECOMPILE}")
    module = build_module(folder, "stage.py", str(ports.get("class", f"Stage{ports.get('stage')}")))
    load_weights(module, folder / "weights.safetensors")
    # a technique's stage module around the generated one (Bi-Partition's workers: core + segments)
    built = first_answer("runtime", "load_stage", folder, module, ports)
    return (module if built is None else built), ports


def build_module(folder: Path, file: str, class_name: str) -> nn.Module:
    """An instance of ``class_name`` from the generated ``folder/file``: its bytes read once,
    checked against the sha256 the compile recorded (``pipecc.runtime.folder_sums``) and compiled
    from memory, never through the import system (no ``__pycache__`` bytecode runs in place of
    the source, and none is written into the folder)."""
    name = f"pipecc_stage_{uuid.uuid4().hex}"
    path = folder / file
    if not path.exists():
        raise PipeccError(f"{folder}: no {file}; {RECOMPILE}")
    data = read_checked(path)
    source = types.ModuleType(name)
    source.__file__ = str(path)  # tracebacks, inspect.getsource and torch's source lookups
    sys.modules[name] = source  # so inspect/torch tooling can find the class's module
    try:
        code = compile(data, str(path), "exec", dont_inherit=True)
        exec(code, source.__dict__)  # noqa: S102 - the stage code, checked against its recorded sha256
        cls = getattr(source, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise PipeccError(f"{folder}/{file} defines no stage module class; {RECOMPILE}")
        return cls()
    except PipeccError:
        raise
    except (Exception, SystemExit) as e:  # generated code that was edited, or needs another environment
        raise PipeccError(f"{folder / file} fails to import ({gist(e)}); it was changed after compile or "
                          f"needs another environment: {RECOMPILE}") from e


def load_weights(module: nn.Module, path: str | Path) -> None:
    """Copy a safetensors file into `module`'s parameters and buffers (every one, by state key)."""
    from safetensors.torch import load

    check_weights_file(path)
    data = read_checked(path)  # the bytes hashed are the bytes loaded
    try:
        tensors = load(data)
    except Exception as e:
        raise PipeccError(f"{path} cannot be read ({gist(e)}); {RECOMPILE}") from None
    expected = dict(module.named_parameters(remove_duplicate=False))
    expected.update(module.named_buffers(remove_duplicate=False))
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise PipeccError(f"{path}: weights do not match the stage module "
                          f"(missing {missing[:5]}, unexpected {unexpected[:5]}); {RECOMPILE}")
    with torch.no_grad():
        for key, value in tensors.items():
            if tuple(expected[key].shape) != tuple(value.shape):
                raise PipeccError(f"{path}: {key!r} has shape {tuple(value.shape)}, the module "
                                  f"expects {tuple(expected[key].shape)}; {RECOMPILE}")
            expected[key].copy_(value)


# ----------------------------------------------------------------------------- original names
def assemble_owner(modules: Sequence[nn.Module]) -> nn.Module:
    """A module holding every stage tensor under its original qualified name (see module doc)."""
    owner = nn.Module()
    registered: dict[str, torch.Tensor] = {}
    for module in modules:
        names: dict[str, str] = getattr(type(module), "PARAM_NAMES", {})
        aliases: dict[str, tuple[str, ...]] = getattr(type(module), "PARAM_ALIASES", {})
        for attr, name in names.items():
            if name in registered:  # a tied weight: every stage uses the first stage's tensor
                _assign(module, attr, registered[name])
                continue
            tensor, persistent = _lookup(module, attr), persistent_buffer(module, attr)
            for qualified in (name, *aliases.get(attr, ())):
                _register(owner, qualified, tensor, persistent)
            registered[name] = tensor
    _assemble_shards(owner, modules, registered)
    return owner


def _assemble_shards(owner: nn.Module, modules: Sequence[nn.Module],
                     registered: dict[str, torch.Tensor]) -> None:
    parts: dict[str, list[tuple[int, int, int, nn.Module, str]]] = {}
    for module in modules:
        for attr, (name, dim, start, size) in getattr(type(module), "SHARDS", {}).items():
            parts.setdefault(name, []).append((start, size, dim, module, attr))
    for name, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        if name in registered or len({p[2] for p in pieces}) != 1 or \
                any(a[0] + a[1] != b[0] for a, b in zip(pieces, pieces[1:])) or pieces[0][0] != 0:
            raise PipeccError(f"the slices of {name!r} in the stages do not tile one parameter")
        dim = pieces[0][2]
        first = _lookup(pieces[0][3], pieces[0][4])
        full = nn.Parameter(torch.cat([_lookup(m, a).detach() for _, _, _, m, a in pieces], dim),
                            requires_grad=first.requires_grad)
        _register(owner, name, full, True)
        registered[name] = full
        for start, size, _, module, attr in pieces:
            module, attr = _split(module, attr)  # a Bi-Partition worker's "core.<attr>" / "segment_<b>.<attr>"
            del module._parameters[attr]
            hook = getattr(module, "_pipecc_shard_views", None)
            if hook is None:
                hook = _ShardViews()
                module.register_forward_pre_hook(hook)
                object.__setattr__(module, "_pipecc_shard_views", hook)
            hook.views.append((attr, full, dim, start, size))


class _ShardViews:
    """Forward pre-hook: set each shard attribute to its slice of the full parameter."""

    def __init__(self) -> None:
        self.views: list[tuple[str, nn.Parameter, int, int, int]] = []

    def __call__(self, module: nn.Module, args: tuple) -> None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        for attr, full, dim, start, size in self.views:
            view = full.narrow(dim, start, size)
            object.__setattr__(module, attr, view if device is None else view.to(device))


def _split(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, last = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    return module, last


def _lookup(module: nn.Module, dotted: str) -> torch.Tensor:
    owner, last = _split(module, dotted)
    return getattr(owner, last)


def persistent_buffer(module: nn.Module, dotted: str) -> bool:
    """False for a buffer registered with `persistent=False` (not in `state_dict()`), else True.

    `dotted` is the qualified name under `module` ("a.b.running_mean", or just "weight").
    """
    owner, last = _split(module, dotted)
    return last not in owner._non_persistent_buffers_set


def _assign(module: nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    owner, last = _split(module, dotted)
    setattr(owner, last, tensor)  # through nn.Module (and RNN) __setattr__: registers and relinks


def _register(owner: nn.Module, qualified: str, tensor: torch.Tensor, persistent: bool) -> None:
    """Register `tensor` at `qualified` ("a.b.weight") in `owner`, creating empty parents."""
    *path, last = qualified.split(".")
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(last, tensor)
    else:
        owner.register_buffer(last, tensor, persistent=persistent)

"""`torch.no_grad()` regions of a torch.export graph, inlined as ops on detached inputs.

torch.export keeps a `with torch.no_grad():` block of forward as one higher-order op,
`wrap_with_set_grad_enabled(False, submodule, *inputs)`, whose body is a nested GraphModule.
Stage code generation, costs and the batch-dimension pass work on flat graphs of ops, and a
region's body could not be cut across stages anyway. So the body is inlined into the graph,
each of its inputs read through `.detach()`: nothing computed from a detached tensor is
recorded by autograd, which is what the region did (the values are the same, no gradient
flows back through them), and an in-place write through a detached view still writes the
buffer it views (an EMA's `self.ema.mul_(0.9)`), as the region did. A region that turns
gradients back on (`wrap_with_set_grad_enabled(True, ...)`) is left as it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

_WRAP = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def inline_no_grad(gm: fx.GraphModule) -> int:
    """Inline every `no_grad` region of `gm` (see the module docstring); how many there were."""
    done = 0
    for node in list(gm.graph.nodes):
        if _WRAP is None or node.op != "call_function" or node.target is not _WRAP:
            continue
        enabled, sub, *inputs = node.args
        body = getattr(gm, str(sub.target), None) if isinstance(sub, fx.Node) else None
        if enabled is not False or not isinstance(body, fx.GraphModule) or node.kwargs:
            continue
        _inline(gm, node, body, inputs)
        if isinstance(sub, fx.Node) and not sub.users:
            gm.graph.erase_node(sub)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _inline(gm: fx.GraphModule, node: fx.Node, body: fx.GraphModule, inputs: list) -> None:
    env: dict[fx.Node, object] = {}
    places = [n for n in body.graph.nodes if n.op == "placeholder"]
    result: object = None
    with gm.graph.inserting_before(node):
        for place, value in zip(places, inputs):
            env[place] = (gm.graph.call_function(torch.ops.aten.detach.default, (value,))
                          if _is_tensor(gm, value) else value)
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = fx.node.map_arg(inner.args[0], lambda n: env[n])
                continue
            if inner.op == "get_attr":  # a constant of the body: moved onto the outer module
                name = _fresh(gm, str(inner.target))
                setattr(gm, name, getattr(body, str(inner.target)))
                env[inner] = gm.graph.get_attr(name)
                continue
            env[inner] = gm.graph.node_copy(inner, lambda n: env[n])
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
    if node.users:  # the tuple itself is used
        with gm.graph.inserting_before(node):
            whole = gm.graph.call_function(tuple, (list(outputs),))
        node.replace_all_uses_with(whole)
    gm.graph.erase_node(node)


def parameter_write(gm: fx.GraphModule) -> str | None:
    """The first parameter that the graph writes in place (an op ending in `_`, or export's
    `copy_` write-back), seen through `detach`, or None.

    NOTE: a pipeline's parameters belong to the optimizer step after backward; a forward that
    changes them in place (`self.w.mul_(0.99)` under no_grad) is refused at capture (in the
    probe of issue 22 it ran and gave other numbers), as torch.export itself refuses most."""
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if node.op not in ("call_function", "call_method") or not name.endswith("_") \
                or name.startswith("_") or not node.args:
            continue
        target = node.args[0]
        while isinstance(target, fx.Node) and target.op == "call_function" \
                and target.target is torch.ops.aten.detach.default:
            target = target.args[0]
        if isinstance(target, fx.Node) and target.op == "get_attr":
            obj: object = gm
            for part in str(target.target).split("."):
                obj = getattr(obj, part, None)
            if isinstance(obj, torch.nn.Parameter):
                return str(target.target)
    return None


def _is_tensor(gm: fx.GraphModule, value: object) -> bool:
    """A node whose value is a tensor (not a SymInt such as a `sym_size` of the batch)."""
    if not isinstance(value, fx.Node):
        return False
    if value.op == "get_attr":
        obj: object = gm
        for part in str(value.target).split("."):
            obj = getattr(obj, part, None)
        return isinstance(obj, torch.Tensor)
    return isinstance(value.meta.get("val"), torch.Tensor)


def _fresh(gm: fx.GraphModule, base: str) -> str:
    name, k = f"_region_{base.replace('.', '_')}", 0
    while hasattr(gm, f"{name}_{k}"):
        k += 1
    return f"{name}_{k}"

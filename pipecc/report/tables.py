"""`pipecc cost` output: the JSON document (its fields are a stable interface) and a readable table."""

from __future__ import annotations

from typing import Any

from pipecc.cost import TOTAL_FIELDS, NodeCost, totals
from pipecc.ir.graph import META_COST, META_KIND, META_NAME, META_OP, META_VALUE, AnnotatedGraph, tensors_in
from pipecc.report.formatting import count, human, text_table

NODE_FIELDS = ("forward_flops", "backward_flops", "forward_flops_matmul", "backward_flops_matmul",
               "param_bytes", "output_bytes", "bytes_moved",
               "backward_weight_flops")  # the weight-gradient part of backward_flops (zero-bubble W)


def cost_json(graph: AnnotatedGraph) -> dict[str, Any]:
    nodes = []
    for node in graph.gm.graph.nodes:
        if node.op == "output":
            continue
        c: NodeCost = node.meta[META_COST]
        entry: dict[str, Any] = {"name": node.meta[META_NAME], "op": node.meta[META_OP],
                                 "kind": node.meta[META_KIND]}
        for f in NODE_FIELDS:
            entry[f] = c.value(f)
        for f in ("forward_flops", "backward_flops", "output_bytes"):
            entry[f + "_expr"] = str(getattr(c, f))
        entry["shapes"] = [t.describe() for t in tensors_in(node.meta.get(META_VALUE))]
        nodes.append(entry)
    sym = totals(graph, symbolic=True)
    total = totals(graph)
    total.update({f + "_expr": str(sym[f]) for f in TOTAL_FIELDS})
    return {"model": graph.model_name, "source": graph.source, "batch_size": graph.batch_size,
            "symbols": {name: int(graph.point[s]) for name, s in graph.symbols.items()},
            "total": total, "warnings": list(graph.warnings), "nodes": nodes}


def cost_table(graph: AnnotatedGraph, by_module: int = 0, max_formula: int = 40) -> str:
    """Per node (or per module prefix of `by_module` path components) table plus totals."""
    data = cost_json(graph)
    headers = ["node" if not by_module else "module", "op", "fwd FLOPs", "formula (fwd)",
               "bwd FLOPs", "params", "output"]
    rows: list[list[str]] = []
    def short(formula: Any) -> str:
        text = str(formula)
        return text[: max_formula - 1] + "…" if len(text) > max_formula else text

    if by_module:
        groups: dict[str, dict[str, Any]] = {}
        costs = [node.meta[META_COST] for node in graph.gm.graph.nodes if node.op != "output"]
        for n, c in zip(data["nodes"], costs):  # the same nodes, in the same order
            key = ".".join(n["name"].split(".")[:by_module])
            g = groups.setdefault(key, {"ops": 0, "forward_flops": 0, "backward_flops": 0,
                                        "param_bytes": 0, "output_bytes": 0, "formula": 0})
            g["ops"] += 1
            g["formula"] += c.forward_flops  # a sum of the nodes' expressions (sympy adds terms)
            for f in ("forward_flops", "backward_flops", "param_bytes", "output_bytes"):
                g[f] += n[f]
        for key, g in groups.items():
            rows.append([key, count(g["ops"], "op"), human(g["forward_flops"]), short(g["formula"]),
                         human(g["backward_flops"]), human(g["param_bytes"], "B"),
                         human(g["output_bytes"], "B")])
    else:
        for n in data["nodes"]:
            rows.append([n["name"], n["op"], human(n["forward_flops"]), short(n["forward_flops_expr"]),
                         human(n["backward_flops"]), human(n["param_bytes"], "B"),
                         human(n["output_bytes"], "B")])
    t = data["total"]
    symbols = ", ".join(f"{k}={v}" for k, v in data["symbols"].items()) or "none"
    lines = [
        f"{graph.model_name}: {count(len(data['nodes']), 'node')}, captured with {graph.source}; "
        f"symbols {symbols}",
        "",
        text_table(headers, rows),
        "",
        f"forward FLOPs   {human(t['forward_flops']):>9}   = {t['forward_flops_expr']}",
        f"  matmul-class  {human(t['forward_flops_matmul']):>9}   = {t['forward_flops_matmul_expr']}",
        f"backward FLOPs  {human(t['backward_flops']):>9}   = {t['backward_flops_expr']}",
        f"  matmul-class  {human(t['backward_flops_matmul']):>9}   = {t['backward_flops_matmul_expr']}",
        f"parameters      {human(t['param_bytes'], 'B'):>9}",
        f"activations     {human(t['activation_bytes'], 'B'):>9}   = {t['activation_bytes_expr']} bytes",
    ]
    lines += [w if w.startswith(("note:", "warning:")) else f"warning: {w}" for w in data["warnings"]]
    return "\n".join(lines)

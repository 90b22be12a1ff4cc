"""A hand-split model for the distributed runtime tests: four pieces, stages built from them.

    piece 0: a = tanh(l0(x));  n = x.shape[0]        sends (a, (ids, n))            a tuple port
    piece 1: b = tanh(l1(a))                          sends (b as [2n, 4], n, a, ids) relays a, ids, n
    piece 2: c = tanh(l2(b)) + a                      sends (c.T, ids, n)            the skip lands
    piece 3: out = (l3(c) + emb(ids)).reshape(n, -1)  the model output

``ids`` are integer token ids (no gradient), ``n`` is a Python int (an object port, once in the
middle of tensors). ``b`` crosses as [2B, 4] (batch dim of 2*B rows) and ``c`` transposed (batch
dim 1), so microbatch shapes come from ``shape_expr``. A stage is a run of consecutive pieces;
its ports are the boundaries around that run, as the compiler writes them to ``ports.json``.
No pipecc compiler code is involved.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

BATCH, D_IN, HIDDEN, D_OUT, VOCAB = 12, 6, 8, 4, 10

# Piece indices per stage, by number of stages.
SPLITS = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]], 3: [[0], [1], [2, 3]], 4: [[0], [1], [2], [3]]}


def _tensor(name: str, shape: list, dtype: str = "float32", requires_grad: bool = True) -> dict:
    """A tensor port; ``shape`` holds ints and the batch expression (a string with B)."""
    point = [eval(d, {"B": BATCH}) if isinstance(d, str) else d for d in shape]  # noqa: S307 - test data
    batch = [i for i, d in enumerate(shape) if isinstance(d, str)]
    return {"name": name, "kind": "tensor", "shape": point, "shape_expr": [str(d) for d in shape], "dtype": dtype,
            "requires_grad": requires_grad, "batch_dim": batch[0] if batch else None}


_IDS = _tensor("ids", ["B"], "int64", requires_grad=False)
_N = {"name": "n", "kind": "object", "value": BATCH}
_A = _tensor("a", ["B", HIDDEN])
# BOUNDARIES[k]: what piece k receives; BOUNDARIES[k + 1]: what it sends.
BOUNDARIES = [
    [_tensor("x", ["B", D_IN], requires_grad=False), _IDS],
    [_A, {"name": "pair", "kind": "tuple", "items": [_IDS, _N]}],
    [_tensor("b", ["2*B", HIDDEN // 2]), _N, _A, _IDS],
    [_tensor("c_t", [HIDDEN, "B"]), _IDS, _N],
    [_tensor("out", ["B", D_OUT])],
]


class Piece0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(D_IN, HIDDEN)

    def forward(self, x, ids):
        return torch.tanh(self.l0(x)), (ids, x.shape[0])


class Piece1(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, a, pair):
        ids, n = pair
        return torch.tanh(self.l1(a)).reshape(2 * n, HIDDEN // 2), n, a, ids


class Piece2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, b, n, a, ids):
        return (torch.tanh(self.l2(b.reshape(n, HIDDEN))) + a).t(), ids, n


class Piece3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l3 = nn.Linear(HIDDEN, D_OUT)
        self.emb = nn.Embedding(VOCAB, D_OUT)

    def forward(self, c_t, ids, n):
        return ((self.l3(c_t.t()) + self.emb(ids)).reshape(n, -1),)


class Chain(nn.Module):
    """Consecutive pieces as one stage; parameters named ``p<k>.<name>`` after piece k."""

    def __init__(self, pieces: dict[int, nn.Module]):
        super().__init__()
        self.parts = nn.ModuleDict({f"p{k}": piece for k, piece in pieces.items()})

    def forward(self, *values):
        for piece in self.parts.values():
            values = piece(*values)
        return values


def build_pieces(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Piece0(), Piece1(), Piece2(), Piece3()]


def build_stages(num_stages: int, seed: int = 0) -> tuple[list[Chain], list[dict]]:
    """Every stage of the ``num_stages``-way split, with its ports (build all, keep yours)."""
    pieces = build_pieces(seed)
    stages, ports = [], []
    for run in SPLITS[num_stages]:
        stages.append(Chain({k: pieces[k] for k in run}))
        ports.append(copy.deepcopy({"receives": BOUNDARIES[run[0]], "sends": BOUNDARIES[run[-1] + 1]}))
    return stages, ports


def batch(seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, D_IN, generator=gen)
    ids = torch.randint(0, VOCAB, (BATCH,), generator=gen)
    return (x, ids), torch.randn(BATCH, D_OUT, generator=gen)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)  # a per-sample mean


def reference(seed: int = 0, data_seed: int = 0) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """Single-process full-batch loss, gradients (by parameter name) and outputs."""
    model = build_stages(1, seed)[0][0]
    inputs, target = batch(data_seed)
    (out,) = model(*inputs)
    loss = loss_fn(out, target)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}, out.detach()

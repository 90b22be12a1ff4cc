"""Property tests: each op's sympy formula against FlopCounterMode's concrete count on
random shapes, and the conventions the cost model states (views, unknown ops, symbols)."""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from helpers import reference_flops
from pipecc import cost, driver
from pipecc.ir.graph import META_COST, META_OP

SETTINGS = settings(max_examples=25, deadline=None)


def _check(model: nn.Module, *inputs: torch.Tensor) -> dict:
    graph = driver.analyze_module(model, inputs, debug=True)
    totals = cost.totals(graph)
    ref_fwd, ref_bwd = reference_flops(model, inputs)
    assert totals["forward_flops_matmul"] == ref_fwd
    assert totals["backward_flops_matmul"] == ref_bwd
    return totals


class _Wrap(nn.Module):
    """A traceable module around fn(submodules, x)."""

    def __init__(self, fn, *mods: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        return self.fn(self.mods, x)


class _Wrap2(_Wrap):
    def forward(self, x, y):
        return self.fn(self.mods, x, y)


class _Wrap3(_Wrap):
    def forward(self, x, y, z):
        return self.fn(self.mods, x, y, z)


@SETTINGS
@given(b=st.integers(1, 4), t=st.integers(1, 3), i=st.integers(1, 9), o=st.integers(1, 9),
       bias=st.booleans(), grad_in=st.booleans())
def test_linear(b, t, i, o, bias, grad_in):
    x = torch.randn(b, t, i, requires_grad=grad_in)
    _check(nn.Linear(i, o, bias=bias), x)


@SETTINGS
@given(b=st.integers(1, 3), cin_g=st.integers(1, 3), cout_g=st.integers(1, 3), groups=st.integers(1, 3),
       k=st.integers(1, 3), stride=st.integers(1, 2), pad=st.integers(0, 2), dil=st.integers(1, 2),
       hw=st.integers(5, 9), dims=st.sampled_from([1, 2]))
def test_conv(b, cin_g, cout_g, groups, k, stride, pad, dil, hw, dims):
    conv = (nn.Conv1d, nn.Conv2d)[dims - 1](cin_g * groups, cout_g * groups, k, stride, pad, dil, groups)
    x = torch.randn(b, cin_g * groups, *([hw] * dims))
    graph = driver.analyze_module(conv, (x,))
    totals = cost.totals(graph)
    ref_fwd, ref_bwd = reference_flops(conv, (x,))
    assert totals["forward_flops_matmul"] == ref_fwd
    # the input needs no gradient: only the weight gradient. torch 2.13 counts it as if
    # groups were 1 (pytorch PR #183405 fixes it); we count it right.
    assert totals["backward_flops_matmul"] == ref_fwd
    assert ref_bwd == groups * totals["backward_flops_matmul"]


def test_grouped_conv_backward_documents_the_reference_bug():
    """torch 2.13 ignores `groups` in convolution backward for the input gradient
    (pytorch PR #183405); we count grad_input as one convolution's worth, like forward."""
    conv = nn.Conv2d(8, 8, 3, padding=1, groups=8)
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    graph = driver.analyze_module(conv, (x,))
    totals = cost.totals(graph)
    fwd = totals["forward_flops_matmul"]
    assert fwd == 2 * 2 * 8 * 6 * 6 * 1 * 9
    assert totals["backward_flops_matmul"] == 2 * fwd  # grad_input + grad_weight
    _, ref_bwd = reference_flops(conv, (x,))
    assert ref_bwd > totals["backward_flops_matmul"]  # if this fails, torch fixed it: drop the note


@SETTINGS
@given(b=st.integers(1, 3), cin=st.integers(1, 4), cout=st.integers(1, 4), k=st.integers(1, 3),
       stride=st.integers(1, 2), pad=st.integers(0, 1), hw=st.integers(3, 6))
def test_conv_transpose(b, cin, cout, k, stride, pad, hw):
    conv = nn.ConvTranspose2d(cin, cout, k, stride, pad)
    x = torch.randn(b, cin, hw, hw)
    _check(conv, x)
    graph = driver.analyze_module(conv, (x,))
    # hand count: every input element scatters into cout*k*k outputs
    assert cost.totals(graph)["forward_flops_matmul"] == 2 * b * cin * hw * hw * cout * k * k


@SETTINGS
@given(batch=st.lists(st.integers(1, 3), min_size=0, max_size=2), m=st.integers(1, 5),
       k=st.integers(1, 5), n=st.integers(1, 5), bcast=st.booleans())
def test_matmul_with_broadcast(batch, m, k, n, bcast):
    a = torch.randn(*batch, m, k, requires_grad=True)
    b = torch.randn(*([] if bcast else batch), k, n, requires_grad=True)
    _check(_Wrap2(lambda mods, x, y: torch.matmul(x, y)), a, b)


@SETTINGS
@given(b=st.integers(1, 2), h=st.integers(1, 3), lq=st.integers(1, 5), s=st.integers(1, 5),
       e=st.integers(1, 6), causal=st.booleans())
def test_sdpa(b, h, lq, s, e, causal):
    if causal:
        s = lq
    q = torch.randn(b, h, lq, e, requires_grad=True)
    k = torch.randn(b, h, s, e, requires_grad=True)
    v = torch.randn(b, h, s, e, requires_grad=True)
    _check(_Wrap3(lambda mods, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), q, k, v)


@SETTINGS
@given(kind=st.sampled_from(["lstm", "gru"]), b=st.integers(1, 3), t=st.integers(1, 4),
       i=st.integers(1, 5), hdim=st.integers(1, 5), layers=st.integers(1, 2),
       bidir=st.booleans(), batch_first=st.booleans(), grad_in=st.booleans())
def test_recurrent(kind, b, t, i, hdim, layers, bidir, batch_first, grad_in):
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    rnn = cls(i, hdim, num_layers=layers, bidirectional=bidir, batch_first=batch_first)
    x = torch.randn(*((b, t) if batch_first else (t, b)), i, requires_grad=grad_in)
    _check(_Wrap(lambda mods, x: mods[0](x)[0], rnn), x)


class _ExportOnly(nn.Module):
    """Python control flow on a shape: torch.fx cannot trace it, torch.export can."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        y = self.rnn(x)[0]
        return y * 2 if x.shape[-1] > 1 else y


@pytest.mark.parametrize("kind,bidir,layers", [("lstm", True, 2), ("gru", False, 3)])
def test_recurrent_through_export(kind, bidir, layers):
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    model = _ExportOnly(cls(3, 4, num_layers=layers, bidirectional=bidir, batch_first=True))
    graph = driver.analyze_module(model, (torch.randn(2, 5, 3),))
    assert graph.source == "export"
    totals = cost.totals(graph)
    assert (totals["forward_flops_matmul"], totals["backward_flops_matmul"]) == \
        reference_flops(model, (torch.randn(2, 5, 3),))


def test_every_listed_op_kind_is_costed():
    """Embedding, norms, pooling, softmax, activations, reductions, reshape/cat."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.bn = nn.BatchNorm1d(4)
            self.ln = nn.LayerNorm(8)
            self.gn = nn.GroupNorm(2, 4)
            self.pool = nn.MaxPool1d(2)

        def forward(self, ids):
            x = self.emb(ids)                 # [B, 4, 8]
            x = self.bn(x)
            x = self.ln(x)
            x = self.gn(x)
            x = torch.softmax(x, -1) + torch.relu(x) * torch.sigmoid(x)
            y = self.pool(x).reshape(x.shape[0], -1)
            return torch.cat([y, x.mean(-1)], 1).sum(-1)

    graph = driver.analyze_module(M(), (torch.randint(0, 10, (3, 4)),), debug=True)
    by_op = {n.meta[META_OP]: n.meta[META_COST] for n in graph.compute_nodes()}
    for op in ["batch_norm", "layer_norm", "group_norm", "softmax", "relu", "sigmoid",
               "max_pool1d", "mean", "sum", "add", "mul"]:
        assert by_op[op].value("forward_flops") > 0, op
    for op in ["reshape", "cat"]:
        assert by_op[op].value("forward_flops") == 0 and by_op[op].value("output_bytes") > 0, op
    assert by_op["reshape"].value("bytes_moved") == 0  # a view moves nothing
    assert by_op["cat"].value("bytes_moved") > 0       # a copy does
    assert by_op["embedding"].value("param_bytes") == 10 * 8 * 4


def test_unknown_op_is_guessed_and_warned_as_a_possible_under_estimate():
    class M(nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x) + 1

    graph = driver.analyze_module(M(), (torch.randn(2, 5),))
    node = next(n for n in graph.compute_nodes() if n.meta[META_OP] == "special_bessel_j0")
    assert node.meta[META_COST].value("forward_flops") == 10
    assert node.meta[META_COST].value("bytes_moved") == 2 * 10 * 4
    warning = next(w for w in graph.warnings if "bessel_j0" in w)
    # one FLOP per element can be far below the real work: never call it "conservative"
    assert "conservative" not in warning and "below their real work" in warning


def test_expressions_are_symbolic_in_batch_and_marked_symbols():
    from helpers import zoo_module
    from pipecc.frontend.torch_capture import SymbolSpec
    zoo = zoo_module("gpt")
    model = zoo.build_model(**zoo.TINY)
    inputs = zoo.example_inputs(2, **zoo.TINY)
    graph = driver.analyze_module(model, inputs, symbols=[SymbolSpec("S", (0,), 1)])
    sym = cost.totals(graph, symbolic=True)
    B, S = graph.symbols["B"], graph.symbols["S"]
    fwd = sym["forward_flops_matmul"]
    assert sympy.degree(fwd, B) == 1 and sympy.degree(fwd, S) == 2  # attention is quadratic
    # evaluating the expression at another point equals analysing at that point
    other = driver.analyze_module(model, zoo.example_inputs(3, **{**zoo.TINY, "seq_len": 5}))
    assert int(fwd.subs({B: 3, S: 5})) == cost.totals(other)["forward_flops_matmul"]


def test_dead_branches_get_no_backward():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            self.unused(x)
            return self.used(x)

    graph = driver.analyze_module(M(), (torch.randn(2, 4),))
    costs = {n.meta["pipecc.name"]: n.meta[META_COST] for n in graph.compute_nodes()}
    assert costs["unused"].value("backward_flops") == 0
    assert costs["used"].value("backward_flops") > 0


@pytest.mark.parametrize("shared", [True])
def test_shared_parameters_are_counted_once(shared):
    lin = nn.Linear(4, 4)
    model = _Wrap(lambda mods, x: mods[0](mods[0](x)), lin)
    graph = driver.analyze_module(model, (torch.randn(2, 4),))
    assert cost.totals(graph)["param_bytes"] == (16 + 4) * 4


@SETTINGS
@given(d=st.sampled_from([8, 16]), heads=st.sampled_from([1, 2, 4]), ff=st.integers(4, 40),
       seq=st.integers(1, 7), batch=st.integers(1, 3), norm_first=st.booleans(),
       activation=st.sampled_from(["relu", "gelu"]), layers=st.integers(1, 2))
def test_transformer_encoder_is_traced_into_and_costed_as_flop_counter(
        d, heads, ff, seq, batch, norm_first, activation, layers):
    """Issue #14 item 8: nn.TransformerEncoder(Layer) was one FLOP per output element (far
    below its work); traced into, its matmul-class FLOPs are FlopCounterMode's exactly."""
    layer = nn.TransformerEncoderLayer(d, heads, ff, 0.0, activation, batch_first=True,
                                       norm_first=norm_first)
    model = nn.Sequential(nn.Linear(5, d), nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                          if layers > 1 else layer)
    totals = _check(model, torch.randn(batch, seq, 5))
    assert totals["forward_flops"] > totals["forward_flops_matmul"]  # norms, softmax, adds


def test_transformer_decoder_layer_is_costed_as_flop_counter():
    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(5, 16)
            self.dec = nn.TransformerDecoderLayer(16, 2, 24, batch_first=True)

        def forward(self, x):
            h = self.inp(x)
            return self.dec(h, h)

    graph = driver.analyze_module(Decoder(), (torch.randn(2, 3, 5),))
    assert not graph.warnings  # nothing guessed
    _check(Decoder(), torch.randn(2, 3, 5))

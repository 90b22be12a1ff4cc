"""A model neither torch.fx nor torch.export can capture is refused in one line that names the
construct (where, and the line of code) and the way out (`pipecc.frontend.capture_errors`)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import ROOT, run_pipecc
from pipecc import driver
from pipecc.errors import CaptureError


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        while h.abs().max() > 1:
            h = h / 2
        return h


class _Detections(nn.Module):
    """A detection head's loop over the boxes that pass a threshold: data-dependent length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.lin(x)
        picked = [scores[i[0]] for i in (scores > 0).nonzero()]
        return torch.stack(picked)


class _Count(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h * len(h[h > 0])


@pytest.mark.parametrize("model, construct, code, fix", [
    (_Branch, "branches on a tensor's value", "while h.abs().max() > 1:", "torch.where(cond, a, b)"),
    (_Detections, "iterates over a tensor", "picked = [scores[i[0]] for i in (scores > 0).nonzero()]",
     "give the loop a length fixed when the model is built"),
    (_Count, "takes len() of a tensor", "return h * len(h[h > 0])", "x * mask instead of x[mask]"),
])
def test_data_dependent_control_flow_is_named_in_one_line(model, construct: str, code: str, fix: str) -> None:
    with pytest.raises(CaptureError) as err:
        driver.analyze_module(model(), (torch.randn(3, 4),))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("could not capture the model: ")
    assert construct in message and f"test_capture_refusals.py:" in message and f"(`{code}`)" in message
    assert fix in message and "torch.fx cannot trace and torch.export cannot capture either" in message


def test_cli_refusal_is_one_line() -> None:
    done = run_pipecc("cost", str(ROOT / "tests" / "data" / "uncapturable.py"))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipecc: error: could not capture the model: ")
    assert "branches on a tensor's value at uncapturable.py:12 (`if y.sum() > 0:`)" in lines[0]
    assert "Traceback" not in done.stderr

"""A pipeline plan: which nodes each stage holds, on which device, under which schedule.

The plan is data with a stable JSON form (CONTRACT §5); `Plan.from_json(plan.to_json())`
round-trips. Backends read a plan together with the (possibly rewritten) annotated graph
whose human node names (`META_NAME`) the plan lists.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO, TypeVar

from pipecc.errors import PipeccError
from pipecc.ir import plan_data
from pipecc.report.formatting import count, human, seconds, text_table, wrap


@dataclass
class StagePlan:
    index: int
    device: int
    nodes: list[str]
    forward_s: float = 0.0
    backward_s: float = 0.0
    # the part of backward_s that computes weight gradients (a zero-bubble schedule's W; the
    # rest is its I); 0.0 in plans written before the split
    backward_weight_s: float = 0.0
    send_bytes: int = 0           # bytes this stage sends forward per micro-batch
    recv_bytes: int = 0           # bytes it receives per micro-batch
    comm_s: float = 0.0           # its communication time per micro-batch (fwd + bwd)
    peak_memory_bytes: int = 0
    forward_flops: int = 0
    param_bytes: int = 0
    # where forward_s/backward_s came from: "profile" (measured curves), "roofline",
    # "mixed" (measured where the profile has the node), "fpga-model"; "" in older plans
    time_source: str = ""
    # PP x DP (Plan.replicas > 1): the plan-device indices of the group running this stage, replica
    # r on replica_devices[r] (= rank); each replica takes 1/replicas of every micro-batch and the
    # group all-reduces the stage's gradients. [] in a plan without replication (= [device]).
    replica_devices: list[int] = field(default_factory=list)
    allreduce_s: float = 0.0      # predicted seconds of the group's gradient all-reduce per iteration
    # activation recomputation (`--recompute`): the stage keeps only its received inputs per
    # micro-batch and re-runs its forward during backward (torch.utils.checkpoint in its
    # generated forward); backward_s then includes that second forward. False in older plans.
    recompute: bool = False
    # Bi-Partition (`--bipartition auto`, techniques.bipartition.search): `nodes` is this worker's FORWARD
    # range and `backward_nodes` its BACKWARD range, both contiguous in graph order; [] = the
    # same as `nodes` (no Bi-Partition). See Plan.bipartition_pieces for the derived segments.
    backward_nodes: list[str] = field(default_factory=list)
    # per micro-batch, the bytes of segment saved tensors ("stash") this stage sends to a
    # neighbour (with its forward message when a_j > c_j, with its gradient message when
    # c_{j-1} > a_{j-1}); 0 without Bi-Partition
    extra_send_bytes: int = 0
    # the fixed part (per call and per micro-batch, `pipecc.targets.fixed_costs`: constant in the
    # micro-batch size) of forward_s / backward_s, and the stage's per-iteration fixed seconds
    # after its last action (optimizer step); 0.0 in older plans
    fixed_forward_s: float = 0.0
    fixed_backward_s: float = 0.0
    step_s: float = 0.0
    # the part of forward_s / backward_s (and of the fixed parts) that is host work outside the
    # stage's timed actions (posting sends, the engine's loop), per micro-batch: what a run's
    # `host_s` measured, by `--calibrate` (`pipecc.targets.calibrated`); 0.0 uncalibrated
    host_forward_s: float = 0.0
    host_backward_s: float = 0.0


@dataclass
class SplitLayer:
    node: str        # the original node's name
    parts: int
    dim: int         # 0: output features/channels; 1: input features (partial sums); table rows
    sizes: list[int] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)  # names of the shard nodes


T = TypeVar("T")


@dataclass
class Plan:
    model: str
    batch_size: int
    microbatches: int
    schedule: str
    devices: list[dict[str, Any]]
    stages: list[StagePlan]
    split_layers: list[SplitLayer]
    # steady-state seconds per micro-batch (B/m samples) of the pipeline, whose ranks are replica
    # groups when replicas > 1 (the all-reduce, once per iteration, is in predicted_iteration_s)
    bottleneck_s: float
    # no plan with this micro-batch count beats bottleneck_s = lower_bound_s: any cuts, layer
    # splits or replication degree the devices allow (`passes.plan_emit.lower_bound`)
    lower_bound_s: float
    predicted_iteration_s: float
    bubble_fraction: float
    dtype: str = "fp32"
    virtual_stages: int = 1
    decisions: list[str] = field(default_factory=list)      # why this schedule/m/order
    alternatives: list[dict[str, Any]] = field(default_factory=list)  # schedules that lost
    baselines: list[dict[str, Any]] = field(default_factory=list)
    model_args: dict[str, Any] = field(default_factory=dict)
    model_path: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    # the comm-blind bound (no message costs; CONTRACT §6b), shown next to lower_bound_s: how much
    # of the distance to the bound is communication
    # (0.0: a plan written before it)
    lower_bound_compute_s: float = 0.0
    # PP x DP: every stage runs on `replicas` devices (1: plain pipeline; replicas == number of
    # devices with one stage: plain data parallelism). Pipeline rank j, replica r is rank
    # j * replicas + r and runs on devices[j * replicas + r]; see StagePlan.replica_devices.
    replicas: int = 1
    # UMPIPE: per stage, its chunk sizes in sample order (positive, each list summing to
    # batch_size), used for its forward and its backward chunks under gpipe row order; None:
    # every stage splits the batch into `microbatches` equal chunks. With sizes, `microbatches`
    # is stage 0's chunk count. (`pipecc plan --microbatch-sizes`, `techniques.umpipe.search`.)
    microbatch_sizes: list[list[int]] | None = None
    # Bi-Partition: "" (off: every stage's backward range is its forward range), "ship" (the
    # runtime mode: a misplaced segment's saved tensors travel to its backward worker) or
    # "recompute" (costed only; compile refuses it)
    bipartition_mode: str = ""
    # bytes of the replica refresh per iteration: every segment's parameters, sent by the owner
    # (backward worker) to the forward worker after each optimizer step
    weight_sync_bytes: int = 0
    # BPipe (PAPERS-SPEC.md 2.3, `--activation-balancing`, `pipecc.techniques.bpipe.search`): per pair, the evictor
    # stage s, its acceptor p-1-s, the evictor's threshold K (stashes it keeps) and the return
    # policy: [{"evictor": s, "acceptor": a, "threshold": K, "policy": "jit"}]; [] = no BPipe.
    # The schedule is pipecc.techniques.bpipe.schedule.bpipe(one_f_one_b(p, m), thresholds, policy)
    # (`pipecc.techniques.schedule_of`).
    activation_balancing: list[dict[str, Any]] = field(default_factory=list)
    # the BPipe estimate (PAPERS-SPEC.md 2.7) behind the decision, whether BPipe was used or
    # not: baseline and bpipe {"microbatch_size", "recompute", "microbatches", "iteration_s",
    # "peak_memory_bytes"}, "speedup", "hidden_fraction", "reason"; {} when not evaluated
    estimate: dict[str, Any] = field(default_factory=dict)
    # each technique's side data (its search's record, the figures its report rebuilds from),
    # plan.json key -> its value, typed by the technique's package (`pipecc.ir.plan_data`; read
    # with `data`, added with `with_data`); plan.json keeps it inside "options"
    technique_data: dict[str, Any] = field(default_factory=dict)

    def data(self, kind: type[T]) -> T | None:
        """The plan's value of the technique data type `kind` (`pipecc.ir.plan_data`), or None."""
        value = self.technique_data.get(kind.KEY)  # type: ignore[attr-defined]
        return value if isinstance(value, kind) else None

    def with_data(self, *values: Any) -> "Plan":
        """A copy of the plan (`dataclasses.replace`: its lists shared) holding `values`, each in
        place of the plan's value of its type."""
        return dataclasses.replace(self, technique_data={**self.technique_data, **{v.KEY: v for v in values}})

    def bpipe_thresholds(self) -> list[int | None]:
        """Per stage, its BPipe threshold K (evictors) or None: `schedule.bpipe`'s argument."""
        out: list[int | None] = [None] * len(self.stages)
        for pair in self.activation_balancing:
            out[int(pair["evictor"])] = int(pair["threshold"])
        return out

    @property
    def balance_ratio(self) -> float:
        return self.bottleneck_s / self.lower_bound_s if self.lower_bound_s > 0 else float("inf")

    @property
    def balance_ratio_compute(self) -> float:
        """bottleneck / the comm-blind bound."""
        lb = self.lower_bound_compute_s
        return self.bottleneck_s / lb if lb > 0 else float("inf")

    @property
    def pipeline_ranks(self) -> int:
        """P = devices / replicas: the pipeline's ranks (replica groups when replicas > 1)."""
        return max(len(self.devices) // max(self.replicas, 1), 1)

    def stage_devices(self, stage: StagePlan) -> list[int]:
        """The plan-device indices running `stage` (its replica group; [device] without one)."""
        return list(stage.replica_devices) or [stage.device]

    def stage_of(self) -> dict[str, int]:
        """Node name -> stage index."""
        return {name: s.index for s in self.stages for name in s.nodes}

    def is_bipartition(self) -> bool:
        """True if some stage's backward range differs from its forward range."""
        return any(s.backward_nodes and s.backward_nodes != s.nodes for s in self.stages)

    def bipartition_pieces(self) -> list[tuple[str, int, int, list[str]]]:
        """The plan's nodes in graph order, grouped by (forward worker, backward worker).

        Returns `("core", j, j, nodes)` for nodes whose forward and backward both run on
        worker j and `("segment", fp_worker, bp_worker, nodes)` for a misplaced segment, in
        graph order (the stages' forward ranges concatenated). A segment lies between two
        neighbouring workers: `bp_worker == fp_worker + 1` when a_j > c_j (its saved tensors
        travel forward, parameters owned by fp_worker + 1), `bp_worker == fp_worker - 1` when
        c_j > a_j (saved tensors travel with the gradient message, owned by fp_worker - 1).
        Without Bi-Partition every stage is one core. Raises PipeccError when the backward
        ranges are not a contiguous, ordered cover of the forward ranges' nodes or a worker's
        core is empty (v1 requires one).
        """
        order = [n for s in self.stages for n in s.nodes]
        fp = {n: s.index for s in self.stages for n in s.nodes}
        bp: dict[str, int] = {}
        for s in self.stages:
            for n in (s.backward_nodes or s.nodes):
                if n not in fp:
                    raise PipeccError(f"plan: stage {s.index}'s backward range names {n!r}, "
                                      "which no stage's forward range holds; re-plan")
                if n in bp:
                    raise PipeccError(f"plan: node {n!r} is in the backward ranges of stages "
                                      f"{bp[n]} and {s.index}; re-plan")
                bp[n] = s.index
        missing = [n for n in order if n not in bp]
        if missing:
            raise PipeccError(f"plan: node {missing[0]!r} is in no stage's backward range; "
                              "re-plan")
        pieces: list[tuple[str, int, int, list[str]]] = []
        for n in order:
            key = (fp[n], bp[n])
            if pieces and (pieces[-1][1], pieces[-1][2]) == key:
                pieces[-1][3].append(n)
            else:
                kind = "core" if key[0] == key[1] else "segment"
                pieces.append((kind, key[0], key[1], [n]))
        # both cut sequences monotone <=> the backward workers never decrease in graph order,
        # and a segment sits between neighbours
        for prev, cur in zip(pieces, pieces[1:]):
            if cur[2] < prev[2]:
                raise PipeccError("plan: backward ranges are not in stage order (node "
                                  f"{cur[3][0]!r}); re-plan")
        for kind, f, b, nodes in pieces:
            if kind == "segment" and abs(f - b) != 1:
                raise PipeccError(f"plan: nodes from {nodes[0]!r} run forward on stage {f} and "
                                  f"backward on stage {b}, which are not neighbours; re-plan")
        cores = {f for kind, f, _, _ in pieces if kind == "core"}
        for s in self.stages:
            if s.index not in cores:
                raise PipeccError(f"plan: stage {s.index} has no node whose forward and "
                                  "backward both run on it (Bi-Partition v1 needs one); re-plan")
        return pieces

    def fpga_stages(self) -> dict[int, str]:
        """Stage index -> FPGA card name, for the stages this plan places on FPGA devices."""
        out: dict[int, str] = {}
        for s in self.stages:
            dev = self.devices[s.device] if 0 <= s.device < len(self.devices) else {}
            if dev.get("kind") == "fpga":
                out[int(s.index)] = str(dev.get("name"))
        return out

    # -- for people (the Python API: `pm.plan`); `pipecc plan` prints report.text.plan_table
    def __repr__(self) -> str:
        """One line: the dataclass's own repr is thousands of characters (issue 21)."""
        shape = count(len(self.stages), "stage")
        if self.replicas > 1:
            shape += f" x {count(self.replicas, 'replica')}"
        mbs = ("unequal micro-batches" if self.microbatch_sizes
               else count(self.microbatches, "micro-batch"))
        return (f"Plan({self.model}: {shape} on {devices_text([d.get('name', '?') for d in self.devices])}, "
                f"batch {self.batch_size} in {mbs}, schedule {self.schedule}, "
                f"{seconds(self.predicted_iteration_s)} per iteration predicted)")

    def __str__(self) -> str:
        return self.summary_text()

    def summary_text(self) -> str:
        """What `summary` prints: the one-line description, the stage table, the figures."""
        slowest = max(range(len(self.stages)), default=0,
                      key=lambda i: self.stages[i].forward_s + self.stages[i].backward_s + self.stages[i].comm_s)
        rows = [[f"{s.index}{' *' if s.index == slowest else ''}",
                 devices_text([self.devices[d].get("name", "?") if 0 <= d < len(self.devices) else "?"
                               for d in self.stage_devices(s)]),
                 s.nodes[0] if s.nodes else "-", s.nodes[-1] if s.nodes else "-", str(len(s.nodes)),
                 seconds(s.forward_s), seconds(s.backward_s), seconds(s.comm_s), human(s.peak_memory_bytes, "B")]
                for s in self.stages]
        table = text_table(["stage", "device", "first node", "last node", "nodes", "fwd", "bwd", "comm",
                            "peak mem"], rows, left=4)
        return "\n".join([
            *wrap(repr(self)), "", table, "",
            *wrap(f"bottleneck {seconds(self.bottleneck_s)} per micro-batch (stage marked *; communication "
                  "overlapped as the runtime sends), lower bound "
                  f"{seconds(self.lower_bound_s)}, bubble {self.bubble_fraction:.1%}"),
            *wrap(f"times predicted from {cost_basis(self)}")])

    def summary(self, file: TextIO | None = None) -> str:
        """The stage table (per micro-batch: forward, backward, communication, peak memory) as
        text, as `pipecc plan` shows it on the command line: `print(pm.plan.summary())`;
        `str(plan)` is the same text. With `file`, it is also written there."""
        text = self.summary_text()
        if file is not None:
            print(text, file=file)
        return text

    def to_json(self) -> dict[str, Any]:
        data = asdict(dataclasses.replace(self, technique_data={}))
        del data["technique_data"]
        data["options"] = plan_data.merge(data["options"], self.technique_data)
        data["balance_ratio"] = self.balance_ratio
        data["balance_ratio_compute"] = self.balance_ratio_compute
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        data = dict(data)
        data.pop("balance_ratio", None)
        data.pop("balance_ratio_compute", None)
        data["stages"] = [StagePlan(**s) for s in data["stages"]]
        data["split_layers"] = [SplitLayer(**s) for s in data["split_layers"]]
        if "options" in data:
            data["options"], data["technique_data"] = plan_data.split(data["options"] or {})
        return cls(**data)


def cost_basis(plan: Plan) -> str:
    """Where the plan's times come from, for every view that prints one: a calibration (a run's
    measured stage times mapped back), a `pipecc profile` file (measured per node), or the
    roofline of the catalog's datasheet figures (not measured on any machine)."""
    options = plan.options or {}
    calibration = options.get("calibration")
    if isinstance(calibration, dict) and calibration.get("source"):
        return f"calibrated from the run {calibration['source']} (measured stage times mapped onto the plan)"
    if options.get("profile"):
        return f"the profile {options['profile']} (per-node times measured by `pipecc profile`)"
    return ("the roofline of the devices' datasheet figures (`pipecc devices`), not measured "
            "(`pipecc profile` measures this machine)")


def devices_text(names: list[str]) -> str:
    """Device names, runs of one kind counted: ["a100", "a100", "v100"] -> "2x a100, v100"."""
    runs: list[list[Any]] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(f"{k}x {name}" if k > 1 else str(name) for name, k in runs) or "no devices"

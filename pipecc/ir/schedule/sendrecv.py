"""The point-to-point lowering: a compute schedule -> the same rows with their SEND/RECV.

The generators (``pipecc.ir.schedule.generators``) and UMPIPE's row orders
(``pipecc.techniques.umpipe.schedule``: ``gpipe_uneven``, ``one_f_one_b_uneven``) list each rank's compute actions only
(F, B or I and W); ``add_send_recv`` adds the messages between stages on different ranks, by
one rule for every schedule, as torch.distributed.pipelining adds its communication to compute
actions in one pass (``_add_send_recv``). ``schedule_for`` (``registry``) builds every schedule
by name through it; BPipe's stash transfers (``transforms.bpipe``) and the collectives
(``lower``) are added after it.

The rule, per rank, walking its compute actions in order (receives just before the compute
that needs them, sends just after the compute that produces them: what waits least under the
asynchronous sends ``validate`` assumes):

    F(s, k)       before it, RECV_F(s, j) for every chunk j of stage s-1 that overlaps chunk k
                  and was not received yet (with equal micro-batches: j = k); after it,
                  SEND_F(s, k). Only where stage s-1 (s+1) sits on another rank.
    B or I(s, k)  before it, RECV_B(s, k); after it, SEND_B(s, j) for every chunk j of stage
                  s-1 whose overlapping chunks of s have all run their backward now (equal
                  micro-batches: j = k). Only where stage s+1 (s-1) sits on another rank.
    W(s, k)       nothing: it reads no gradient from outside and sends none.

A message on the boundary between stages s and s+1 always carries a chunk of the upstream
stage s (``pipecc.ir.schedule.actions``). The result is not validated here: the caller
(``schedule_for``) validates the final schedule.
"""

from __future__ import annotations

from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.ir.schedule.chunks import overlapping

__all__ = ["add_send_recv"]


def add_send_recv(schedule: Schedule) -> Schedule:
    """``schedule`` (compute actions only) with the SEND/RECV between its stages on different
    ranks, by the rule of the module docstring; same placement and micro-batch sizes.
    O(actions + chunks).

    Raises ValueError when a row holds anything but F, B, I and W (a schedule lowered already,
    or one with stash transfers or collectives, which come after this lowering).
    """
    for r, row in enumerate(schedule.actions):
        for a in row:
            if not a.kind.is_compute:
                raise ValueError(f"add_send_recv lowers compute actions only (F, B, I, W), but rank {r} "
                                 f"runs {a}")
    placement, last = schedule.stage_to_rank, schedule.num_stages - 1
    chunks = [schedule.chunks(s) for s in range(schedule.num_stages)]
    sizes = schedule.microbatch_sizes
    if sizes is None:  # equal micro-batches: chunk k of every stage holds the same samples
        needs = [[[k] for k in range(n)] for n in chunks]
        covers = needs
    else:
        needs = [[]] + [overlapping(sizes[s - 1], sizes[s]) for s in range(1, last + 1)]  # [s][k] -> chunks of s-1
        covers = [overlapping(sizes[s + 1], sizes[s]) for s in range(last)]  # [s][j] -> chunks of s+1
    rows = []
    for rank, row in enumerate(schedule.actions):
        out: list[Action] = []
        received: set[tuple[int, int]] = set()
        graded: set[tuple[int, int]] = set()
        sent: set[tuple[int, int]] = set()
        for a in row:
            s, k = a.stage, a.microbatch
            upstream_remote = s > 0 and placement[s - 1] != rank
            downstream_remote = s < last and placement[s + 1] != rank
            if a.kind is ActionKind.F:
                for j in needs[s][k] if upstream_remote else ():
                    if (s, j) not in received:
                        received.add((s, j))
                        out.append(Action(ActionKind.RECV_F, s, j))
                out.append(a)
                if downstream_remote:
                    out.append(Action(ActionKind.SEND_F, s, k))
            elif a.kind is ActionKind.W:
                out.append(a)
            else:  # B or I: needs the output's gradient, produces the input's
                if downstream_remote:
                    out.append(Action(ActionKind.RECV_B, s, k))
                out.append(a)
                graded.add((s, k))
                for j in needs[s][k] if upstream_remote else ():
                    if (s, j) not in sent and all((s, i) in graded for i in covers[s - 1][j]):
                        sent.add((s, j))
                        out.append(Action(ActionKind.SEND_B, s, j))
        rows.append(tuple(out))
    return Schedule(schedule.num_ranks, schedule.num_stages, schedule.num_microbatches, placement, tuple(rows),
                    sizes, schedule.partner)

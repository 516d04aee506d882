"""torchrun worker: records the p2p calls each rank really makes and replays them under NCCL's rules.

torch.distributed's `batch_isend_irecv`, `isend` and `irecv` are wrapped: every call becomes an
Issue step of this rank's host program (a batch is one group, a lone op a lone group; payload =
dtype and shape, peer = rank in the call's process group) and every `wait()` on a returned work a
Wait step. The pipeline runs with SEQ1F1B_GLOO_P2P=direct, the transport whose host calls are the
NCCL path's (issued at once, waited before use). Rank 0 gathers every rank's programs, splits them
by pipeline process group and replays each set in both NCCL modes; it also compares each rank's
recorded groups with the communication plan's. Compute between the calls needs no recording:
every dependency a group has on earlier work runs through the Wait steps before it. A case with
"prefetch_order" runs the runtime's old order (tests/prefetch_order.py) instead of the plan: gloo
forgives it, the replay must not.

Context parallelism: the all-to-alls and all-reduces a rank issues on its context-parallel group
(megatron's, from parallel_state) are recorded too, in one call-ordered list with its p2p calls.
Rank 0 checks that every CP rank of a group issued the same collectives in the same order, and
replays all ranks' programs together (global ranks, each group on its communicator, a collective
waited at once as torch's synchronous collectives are) in both NCCL modes: lazy, each process
group on its own stream; eager, every communicator of a rank on one stream, where an order across
the two communicators that disagrees between ranks would hang.
"""
import inspect
import json
import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

os.environ["SEQ1F1B_GLOO_P2P"] = "direct"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: prefetch_order

from prefetch_order import prefetch_plan  # noqa: E402
from seq1f1b.distributed import init_distributed, release_model_parallel  # noqa: E402
from seq1f1b.equivalence import EquivalenceCase, case_plan, run_case  # noqa: E402
from seq1f1b.plan import registry, schedule_file  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from seq1f1b.plan.communication import (RECV, SEND, Group, HostProgram, Issue, Op,  # noqa: E402
                                        Wait, collective, communication_plan)
from seq1f1b.plan.nccl import validate_modes  # noqa: E402
from seq1f1b.runtime import p2p  # noqa: E402

WRAPPED = ("batch_isend_irecv", "isend", "irecv")
COLLECTIVES = ("all_to_all_single", "all_reduce")


class Recorder:
    """Per process group (its ranks), this rank's host steps. Lone isend/irecv are wrapped in
    torch.distributed and in distributed_c10d alike (P2POp checks its op against the latter), and
    not recorded again when batch_isend_irecv calls them."""

    def __init__(self) -> None:
        self.steps: dict[tuple[int, ...], list] = {}
        self.calls: list[tuple[tuple[int, ...], object]] = []    # (group ranks, step), in order
        self.collectives: dict[tuple[int, ...], list[str]] = {}  # CP group -> "name payload"
        self.real = {name: getattr(c10d, name) for name in WRAPPED + COLLECTIVES}
        self.in_batch = False
        self.in_collective = False

    def _issue(self, group, ops: list[Op], batched: bool) -> tuple:
        key = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        steps = self.steps.setdefault(key, [])
        index = sum(isinstance(step, Issue) for step in steps)
        steps.append(Issue(Group(tuple(ops), batched)))
        self.calls.append((key, steps[-1]))
        return key, index

    def _collective(self, name: str):
        """A collective on this rank's CP group becomes an Issue and its Wait at once. A call
        made while one is running is the same call re-dispatched (torch's __torch_function__
        handling calls the module's function again, now this wrapper): not recorded twice."""
        real = self.real[name]

        def call(tensor, *args, **kwargs):
            group = kwargs.get("group")
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
            if self.in_collective:
                return real(tensor, *args, **kwargs)
            if group is not None and group is cp_group and group.size() > 1:
                key = tuple(dist.get_process_group_ranks(group))
                payload = _payload(tensor)
                self.collectives.setdefault(key, []).append(f"{name} {payload}")
                index = sum(isinstance(step, Issue) for k, step in self.calls if k == key)
                self.calls.append((key, Issue(collective(name, payload, key, dist.get_rank()))))
                self.calls.append((key, Wait(index)))
            self.in_collective = True
            try:
                return real(tensor, *args, **kwargs)
            finally:
                self.in_collective = False
        return call

    def _works(self, works, key, index):
        recorder = self

        class RecordedWork:
            def __init__(self, work):
                self.work = work

            def wait(self, *args, **kwargs):
                recorder.steps[key].append(Wait(index))
                recorder.calls.append((key, Wait(index)))
                return self.work.wait(*args, **kwargs)

            def is_completed(self):
                return self.work.is_completed()

        return [RecordedWork(work) for work in works]

    def _batch(self, p2p_op_list):
        ops = [Op(SEND if op.op is self.wrappers["isend"] else RECV, op.group_peer,
                  _payload(op.tensor)) for op in p2p_op_list]
        key, index = self._issue(p2p_op_list[0].group, ops, True)
        self.in_batch = True
        try:
            return self._works(self.real["batch_isend_irecv"](p2p_op_list), key, index)
        finally:
            self.in_batch = False

    def _lone(self, name: str, kind: str):
        real = self.real[name]

        def call(*args, **kwargs):
            if self.in_batch:
                return real(*args, **kwargs)
            bound = inspect.signature(real).bind(*args, **kwargs).arguments
            group = bound.get("group")
            group_peer = bound.get("group_dst", bound.get("group_src"))
            if group_peer is None:
                group_peer = dist.get_group_rank(group or dist.group.WORLD,
                                                 bound.get("dst", bound.get("src")))
            key, index = self._issue(group, [Op(kind, group_peer, _payload(bound["tensor"]))],
                                     False)
            (work,) = self._works([real(*args, **kwargs)], key, index)
            return work
        return call

    def install(self) -> None:
        self.wrappers = {"batch_isend_irecv": self._batch, "isend": self._lone("isend", SEND),
                         "irecv": self._lone("irecv", RECV),
                         **{name: self._collective(name) for name in COLLECTIVES}}
        for module in (dist, c10d):
            for name, function in self.wrappers.items():
                setattr(module, name, function)

    def uninstall(self) -> None:
        for module in (dist, c10d):
            for name, function in self.real.items():
                setattr(module, name, function)

    def take(self) -> dict:
        recorded = {"steps": self.steps, "calls": self.calls, "collectives": self.collectives}
        self.steps, self.calls, self.collectives = {}, [], {}
        return recorded


def _payload(tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def _plan_ops(case: EquivalenceCase, pp_rank: int) -> list:
    schedule = case_plan(case)
    return [[(op.kind, op.peer) for op in g.group.ops]
            for g in communication_plan(schedule).ranks[pp_rank].groups]


def main(cases_path: str, results_path: str) -> None:
    init_distributed(timeout_s=120)
    recorder = Recorder()
    results = []
    for spec in json.load(open(cases_path)):
        prefetch = spec.pop("prefetch_order", False)
        case = EquivalenceCase(**spec)
        if case.pipeline_schedule_file is not None:   # judged against the file's plan
            case = replace(case, schedule=schedule_file.load(case.pipeline_schedule_file).name)
        p2p.communication_plan = prefetch_plan if prefetch else communication_plan
        recorder.install()
        try:
            passed = run_case(case).passed
            error = None
        except Exception as err:  # reported per case; the other cases still run
            passed, error = False, f"{type(err).__name__}: {err}\n{traceback.format_exc()[-2000:]}"
            release_model_parallel()
        recorder.uninstall()
        recorded = recorder.take()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, recorded)
        if dist.get_rank() != 0:
            results.append(None)
            continue
        results.append(_judge(case, gathered, passed, error))
    if dist.get_rank() == 0:
        json.dump(results, open(results_path, "w"))
    dist.destroy_process_group()


def _judge(case: EquivalenceCase, gathered: list[dict], passed: bool, error) -> dict:
    """Replay every pipeline group's recorded programs; compare ours with the plan."""
    groups: dict[tuple, dict[int, list]] = {}
    for rank, recorded in enumerate(gathered):
        for ranks, steps in recorded["steps"].items():
            if len(ranks) == case.pp and case.pp > 1:
                groups.setdefault(ranks, {})[ranks.index(rank)] = steps
    verdicts, plan_equal, issued = {}, True, 0
    for ranks, by_rank in groups.items():
        programs = [HostProgram(r, tuple(by_rank.get(r, ()))) for r in range(case.pp)]
        for mode, verdict in validate_modes(programs).items():
            verdicts.setdefault(mode, []).extend(verdict.problems)
        for program in programs:
            recorded_ops = [[(op.kind, op.peer) for op in g.ops] for g in program.groups()]
            issued += len(recorded_ops)
            if not case.schedule.startswith("megatron-"):
                plan_equal &= recorded_ops == _plan_ops(case, program.rank)
    return {"case": case.schedule, "passed": passed, "error": error, "groups": issued,
            "pipeline_groups": len(groups), "plan_equal": plan_equal,
            "problems": {mode: problems for mode, problems in verdicts.items()},
            **_judge_context_parallel(gathered)}


def _judge_context_parallel(gathered: list[dict]) -> dict:
    """Each CP group's collective sequences (equal on every member?) and the replay of every
    rank's p2p and CP collectives together, in global ranks, in both modes."""
    by_group: dict[tuple, list[list[str]]] = {}
    for recorded in gathered:
        for ranks, names in recorded["collectives"].items():
            by_group.setdefault(ranks, []).append(names)
    if not by_group:
        return {}
    programs = [HostProgram(rank, _global_steps(recorded["calls"]))
                for rank, recorded in enumerate(gathered)]
    return {"cp_collectives": {",".join(map(str, ranks)): [len(names) for names in sequences]
                               for ranks, sequences in by_group.items()},
            "cp_kinds": sorted({name.split()[0] for sequences in by_group.values()
                                for names in sequences for name in names}),
            "cp_same_order": all(len(sequences) == len(ranks) and
                                 all(names == sequences[0] for names in sequences)
                                 for ranks, sequences in by_group.items()),
            "global_problems": {mode: list(verdict.problems)
                                for mode, verdict in validate_modes(programs).items()}}


def _global_steps(calls: list) -> tuple:
    """One rank's calls of all its groups as one host program: peers as global ranks, each group
    on its communicator, waits renumbered to the rank's issues in call order."""
    steps, issued = [], {}
    for key, step in calls:
        if isinstance(step, Issue):
            group = step.group
            if group.communicator is None:      # a p2p group: peers are group ranks
                group = Group(tuple(op._replace(peer=key[op.peer]) for op in group.ops),
                              group.batched, key)
            issued.setdefault(key, []).append(sum(isinstance(s, Issue) for s in steps))
            steps.append(Issue(group))
        else:
            steps.append(Wait(issued[key][step.group]))
    return tuple(steps)


if __name__ == "__main__":
    main(*sys.argv[1:3])

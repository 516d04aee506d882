"""torchrun worker: runs pretrain_gpt.py's training for each case in turn, in one launch.

A case is {"argv": [flags]}, optionally with "sigterm": [rank, iteration]: that rank sends
itself SIGTERM as that iteration starts (as Slurm or torchrun would, on one rank only), and
"record_saves": a file where rank 0 notes each save and the disk before each publish. The flags
are validated for this world and trained with pretrain_gpt.py's own model provider, forward step
and datasets provider. The last rank (which holds the losses) writes one result per case: the
per-iteration history, the evaluations, the start and end iteration, why it stopped early, what
the case printed on that rank (the log lines), how many gradient bucket reductions (after the
first iteration, which only learns the buckets) were launched while the schedule ran versus after
it (`--overlap-grad-reduce` must launch them all while it runs), the collections made while the
collector was off (--manual-gc's) and whether it is on again, how many times
torch.cuda.empty_cache was called, and the seconds it took, or the error.

Imports of megatron-core happen inside the functions: a checkpoint save starts a `spawn` helper
process that re-imports this file, and each of the four ranks would pay for them again.
"""
import contextlib
import gc
import io
import json
import os
import signal
import sys
import time
import traceback
import warnings


@contextlib.contextmanager
def sigterm_at(rank: int, iteration: int):
    """While active, rank `rank` sends itself SIGTERM just before it starts `iteration`."""
    import torch.distributed as dist

    from megatron.training import training

    original = training._Run.train_step

    def train_step(run, iterators):
        if dist.get_rank() == rank and run.iteration == iteration - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(run, iterators)

    training._Run.train_step = train_step
    try:
        yield
    finally:
        training._Run.train_step = original


@contextlib.contextmanager
def saves_recorded(path: str):
    """While active, rank 0 appends to `path` (JSON lines) each checkpoint save as it returns
    ({"scheduled": iteration}) and, just before each is published, what a job killed at that
    moment would leave on disk: the tracker's iteration and whether the staged and the final
    folders exist."""
    import torch.distributed as dist

    from megatron.training import checkpointing
    from seq1f1b import checkpoint_layout

    save, publish = checkpointing.save_checkpoint, checkpoint_layout.publish

    def note(entry: dict) -> None:
        with open(path, "a") as stream:
            stream.write(json.dumps(entry) + "\n")

    def recorded_save(save_dir, model, optimizer, scheduler, position, *args, **kwargs):
        folder = save(save_dir, model, optimizer, scheduler, position, *args, **kwargs)
        if dist.get_rank() == 0:
            note({"scheduled": position.iteration})
        return folder

    def recorded_publish(root, iteration):
        note({"publishing": iteration, "tracker": checkpoint_layout.read_tracker(root),
              "staged": os.path.isdir(checkpoint_layout.staging_dir(root, iteration)),
              "final": os.path.isdir(checkpoint_layout.iteration_dir(root, iteration))})
        return publish(root, iteration)

    checkpointing.save_checkpoint, checkpoint_layout.publish = recorded_save, recorded_publish
    try:
        yield
    finally:
        checkpointing.save_checkpoint, checkpoint_layout.publish = save, publish


def run(argv: list, sigterm: list = None, record_saves: str = None) -> dict:
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import pretrain

    args = validate_args(parse_args(argv), dist.get_world_size())
    with sigterm_at(*sigterm) if sigterm else contextlib.nullcontext(), \
            saves_recorded(record_saves) if record_saves else contextlib.nullcontext():
        summary = pretrain(args, pretrain_gpt.train_valid_test_datasets_provider,
                           pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    return {"start_iteration": summary.start_iteration, "iteration": summary.iteration,
            "history": [vars(record) for record in summary.history],
            "validation": [[where, losses] for where, losses in summary.validation],
            "checkpoints": summary.checkpoints, "stopped_by": summary.stopped_by}


class CollectionProbe:
    """Records the generation of every collection made while the automatic collector is off:
    with --manual-gc, the trainer's own (the automatic ones run only while it is on)."""

    def __init__(self) -> None:
        self.generations: list[int] = []
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start" and not gc.isenabled():
            self.generations.append(info["generation"])

    def take(self) -> dict:
        taken, self.generations = self.generations, []
        return {"generations": taken, "enabled_after": gc.isenabled()}


class EmptyCacheProbe:
    """Counts the calls of torch.cuda.empty_cache (--empty-unused-memory-level's; on the CPU
    each one does nothing)."""

    def __init__(self) -> None:
        import torch

        self.calls, empty_cache = 0, torch.cuda.empty_cache

        def counted() -> None:
            self.calls += 1
            empty_cache()

        torch.cuda.empty_cache = counted

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


class ReductionProbe:
    """Counts megatron's bucket reductions launched inside and outside the executor's run."""

    def __init__(self) -> None:
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

        from seq1f1b.runtime.executor import Executor

        self.inside = False
        self.counts = {"in_schedule": 0, "after_schedule": 0}
        probe, run, start = self, Executor.run, _ParamAndGradBucketGroup.start_grad_sync

        def probed_run(executor):
            probe.inside = True
            try:
                return run(executor)
            finally:
                probe.inside = False

        def probed_start(group, *args, **kwargs):
            if not group.is_first_batch:
                probe.counts["in_schedule" if probe.inside else "after_schedule"] += 1
            return start(group, *args, **kwargs)

        Executor.run = probed_run
        _ParamAndGradBucketGroup.start_grad_sync = probed_start

    def take(self) -> dict:
        counts, self.counts = self.counts, {"in_schedule": 0, "after_schedule": 0}
        return counts


def main(cases_path: str, results_path: str) -> None:
    import torch
    import torch.distributed as dist

    from seq1f1b.distributed import init_distributed

    warnings.simplefilter("ignore", UserWarning)
    torch.set_num_threads(1)
    init_distributed(timeout_s=300)
    probe, collections, empty_caches = ReductionProbe(), CollectionProbe(), EmptyCacheProbe()
    # what every case imports, frozen once: each case's collections skip its ~330k objects
    import pretrain_gpt  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim's first parameter group imports it)
    from megatron.training import training  # noqa: F401
    gc.freeze()
    results = []
    for case in json.load(open(cases_path)):
        start = time.perf_counter()
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                result = run(case["argv"], case.get("sigterm"), case.get("record_saves"))
        except Exception as err:  # reported per case; the other cases still run
            result = {"error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-3000:]}
        result["stdout"] = printed.getvalue()
        result["grad_reductions"] = probe.take()
        result["manual_collections"] = collections.take()
        result["empty_cache_calls"] = empty_caches.take()
        result["seconds"] = round(time.perf_counter() - start, 2)
        results.append(result)
        gc.collect()    # not the case's groups: see CASES_PER_LAUNCH in test_training.py
    if dist.get_rank() == dist.get_world_size() - 1:
        json.dump(results, open(results_path, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])

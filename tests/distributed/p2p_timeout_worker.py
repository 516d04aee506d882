"""torchrun x2 worker: pipeline channels that cannot finish must fail after --p2p-timeout with a
message naming the ranks and the messages, instead of hanging.

Cases (each rank drives its channels through the schedule's program with dummy tensors, as the
executor would, without a model):
- "silent": rank 0 never sends; rank 1's first receive times out.
- "prefetch": both ranks run the runtime's old order (tests/prefetch_order.py) for 1f1b at P=2,
  m=4; on gloo's NCCL-order stream it deadlocks as NCCL would.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: prefetch_order

from prefetch_order import prefetch_plan  # noqa: E402
from seq1f1b.distributed import init_distributed  # noqa: E402
from seq1f1b.plan import registry  # noqa: E402
from seq1f1b.runtime.p2p import PipelineChannels  # noqa: E402

SHAPE = (4, 1, 8)


def drive(channels: PipelineChannels, program) -> None:
    channels.start()
    for action in program:
        channels.receive(action)
        channels.send(action, torch.zeros(SHAPE))
        channels.after(action)
    channels.finish()


def main(cases_path: str, results_path: str) -> None:
    init_distributed(timeout_s=60)
    rank = dist.get_rank()
    results = []
    for case in json.load(open(cases_path)):
        timeout_s = case["timeout_s"]
        group = dist.new_group([0, 1])   # a case's stuck receives must not meet the next case
        start = time.time()
        error = None
        if case["kind"] == "silent":
            schedule = registry.build("seq1f1b", 2, 2, 2)
            if rank == 0:
                time.sleep(3 * timeout_s)   # alive but silent: rank 1 must time out
            else:
                try:
                    drive(PipelineChannels(schedule, 1, group, lambda span: SHAPE, torch.float32,
                                           torch.device("cpu"), timeout_s=timeout_s),
                          schedule.programs[1])
                except RuntimeError as err:
                    error = str(err)
        else:
            schedule = registry.build("1f1b", 2, 4, 1)
            channels = PipelineChannels(schedule, rank, group, lambda span: SHAPE, torch.float32,
                                        torch.device("cpu"), timeout_s=timeout_s,
                                        plan=prefetch_plan(schedule).ranks[rank])
            try:
                drive(channels, schedule.programs[rank])
            except RuntimeError as err:
                error = str(err)
        errors = [None, None]
        dist.all_gather_object(errors, {"error": error, "seconds": time.time() - start})
        results.append(errors)
    if rank == 0:
        json.dump(results, open(results_path, "w"))
    # The stream workers still sit in gloo receives that will never match: leave at once.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""torchrun worker that never finishes: rank 0 waits in a barrier rank 1 never joins, rank 1
sleeps, having left an orphan that holds the launch's output. It stands for a launch stuck
where no test can see (see launch.py's timeout)."""
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def wait_in_barrier() -> None:
    dist.barrier()


def sleep_forever() -> None:
    while True:
        time.sleep(1)


ORPHAN_SECONDS = 600
"""How long the orphan holds the launch's output: a run_cases that waits for it takes this."""


def leave_an_orphan_holding_the_output() -> None:
    """A process outside the launch's tree with its stdout and stderr, as a rank's
    multiprocessing Manager server was once, when its parent had ended before the timeout."""
    if os.fork() == 0:
        if os.fork() == 0:
            time.sleep(ORPHAN_SECONDS)
        os._exit(0)
    os.wait()


def main(cases_path: str, results_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(hours=1))
    if dist.get_rank() == 1:
        leave_an_orphan_holding_the_output()
    wait_in_barrier() if dist.get_rank() == 0 else sleep_forever()


if __name__ == "__main__":
    main(*sys.argv[1:3])

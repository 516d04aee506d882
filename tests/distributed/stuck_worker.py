"""torchrun worker that never finishes: rank 0 waits in a barrier rank 1 never joins, rank 1
sleeps. It stands for a launch stuck where no test can see (see launch.py's timeout)."""
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def wait_in_barrier() -> None:
    dist.barrier()


def sleep_forever() -> None:
    while True:
        time.sleep(1)


def main(cases_path: str, results_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(hours=1))
    wait_in_barrier() if dist.get_rank() == 0 else sleep_forever()


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""torchrun x2 worker: rank 0 never sends; rank 1's receive must fail with a message that names
the rank, the action and the peer after the configured timeout instead of hanging."""
import json
import sys
import time

import torch
import torch.distributed as dist

from seq1f1b.distributed import init_distributed
from seq1f1b.plan import registry
from seq1f1b.runtime.p2p import PipelineChannels


def main(cases_path: str, results_path: str) -> None:
    init_distributed(timeout_s=60)
    schedule = registry.build("seq1f1b", 2, 2, 2)
    results = []
    timeout_s = json.load(open(cases_path))[0]["timeout_s"]
    if dist.get_rank() == 0:
        time.sleep(3 * timeout_s)      # alive but silent: rank 1 must time out, not see a crash
    else:
        channels = PipelineChannels(schedule, 1, None, lambda span: (4, 1, 8), torch.float32,
                                    torch.device("cpu"), timeout_s=timeout_s)
        try:
            channels.receive(schedule.programs[1][0])
            results.append({"error": None})
        except RuntimeError as err:
            results.append({"error": str(err)})
        json.dump(results, open(results_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])

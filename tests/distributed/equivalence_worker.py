"""torchrun worker: runs each equivalence case in turn; rank 0 writes the results as JSON, each
with whether strict CUDA mode was on (`strict`)."""
import gc
import json
import sys
import traceback

import torch.distributed as dist

from seq1f1b.distributed import init_distributed, release_model_parallel
from seq1f1b import platform
from seq1f1b.equivalence import EquivalenceCase, run_case


def main(cases_path: str, results_path: str) -> None:
    init_distributed(timeout_s=120)
    gc.freeze()     # what is imported lives on: each case's collections skip its ~280k objects
    results = []
    for spec in json.load(open(cases_path)):
        try:
            result = vars(run_case(EquivalenceCase(**spec)))
        except Exception as err:  # reported per case; the other cases still run
            result = {"passed": False, "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-3000:], "case": spec}
            release_model_parallel()
        result["strict"] = platform.is_strict()
        results.append(result)
    if dist.get_rank() == 0:
        json.dump(results, open(results_path, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])

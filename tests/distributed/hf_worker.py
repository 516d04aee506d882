"""torchrun worker of test_hf.py: Hugging Face parity cases and pretrain_gpt.py training cases in
one launch (imports and start-up cost ~5 s per process).

A case is {"parity": {ParityCase fields}} (megatron.training.hf_parity.run_parity; rank 0 holds the result)
or {"argv": [flags]} (training_worker.run; the last rank holds the result). Every rank writes its
results to results.json.rank<R>; rank 0 merges them, taking each case's result from the rank that
has it.
"""
import json
import sys
import time
import traceback
import warnings


def run_case(case: dict) -> dict:
    if "parity" in case:
        from megatron.training.hf_parity import ParityCase, run_parity

        result = run_parity(ParityCase(**case["parity"]))
        return {} if result is None else {"holder": True, **vars(result)}
    from training_worker import run

    import torch.distributed as dist

    result = run(case["argv"])
    return {"holder": True, **result} if dist.get_rank() == dist.get_world_size() - 1 else {}


def main(cases_path: str, results_path: str) -> None:
    import torch
    import torch.distributed as dist

    from seq1f1b.distributed import init_distributed

    warnings.simplefilter("ignore", UserWarning)
    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(1)
    init_distributed(timeout_s=300)
    results = []
    for case in json.load(open(cases_path)):
        start = time.perf_counter()
        try:
            result = run_case(case)
        except Exception as err:  # reported per case; the other cases still run
            result = {"holder": True, "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        results.append(result)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        merged = [next((r for r in per_case if r.get("holder")), per_case[0])
                  for per_case in zip(*gathered)]
        json.dump(merged, open(results_path, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])

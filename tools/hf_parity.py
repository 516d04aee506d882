"""Parity of a converted Hugging Face model with transformers: pipelined with spans, in fp32.

    python tools/hf_parity.py --hf-dir D --json
    torchrun --nproc-per-node 4 tools/hf_parity.py --hf-dir D --tp 2 --pp 2 --splits 3 --json

Converts D (Llama / Mistral / Qwen2: config.json + safetensors) to a release checkpoint in a
temporary folder, loads it at --tp x --pp (x --vpp) on the torchrun world (which must be TP x
PP), runs one forward pass of random tokens through --schedule with --splits spans, and compares
the logits and the loss with transformers' forward (eager attention) on the same tokens
(PP micro-batches of --micro-batch-size sequences). Prints
{"max_abs_logit_diff", "loss", "hf_loss", "passed", ...} with --json (a sentence without); exit
code 0 when passed, 1 when not, 2 for bad input (one line naming the flag or file). The
threshold is megatron.training.hf_parity's docstring: 1e-4 of the logits' scale, fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=1,
                        help="model chunks per pipeline rank (interleaved schedules)")
    parser.add_argument("--splits", type=int, default=1, help="Seq1F1B spans per sequence (k)")
    parser.add_argument("--schedule", default="seq1f1b", help="pipeline schedule (registry name)")
    parser.add_argument("--seq-length", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=2,
                        help="sequences per micro-batch (PP micro-batches are run)")
    parser.add_argument("--seed", type=int, default=1234, help="draws the tokens")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser.parse_args(argv)


def _world() -> None:
    """torchrun's process group, or a world of one (NCCL on a GPU, gloo with the CPU platform
    layer otherwise)."""
    import torch
    import torch.distributed as dist

    from seq1f1b import platform
    from seq1f1b.distributed import init_distributed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if "RANK" in os.environ:
        init_distributed()
    elif torch.cuda.is_available():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    else:
        platform.activate()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def main(argv=None) -> int:
    import torch.distributed as dist

    from seq1f1b.hf import ConversionError
    from megatron.training.hf_parity import ParityCase, run_parity

    args = parse_args(argv)
    case = ParityCase(hf_dir=args.hf_dir, tp=args.tp, pp=args.pp, vpp=args.vpp,
                      splits=args.splits, schedule=args.schedule, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, seed=args.seed)
    _world()
    try:
        result = run_parity(case)
    except ConversionError as err:
        if dist.get_rank() == 0:
            print(f"hf_parity.py: error: {err}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    if result is None:
        return 0
    if args.json:
        print(json.dumps(vars(result)))
    else:
        print(f"max |logit difference| {result.max_abs_logit_diff:.3e} (largest |logit| "
              f"{result.max_abs_logit:.3g}), loss {result.loss:.6f} vs transformers "
              f"{result.hf_loss:.6f}: {'passed' if result.passed else 'FAILED'}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    from seq1f1b.import_notices import hide_import_notices

    hide_import_notices(future_warnings=True)
    sys.exit(main())

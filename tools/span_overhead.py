#!/usr/bin/env python3
"""What the runtime's Python costs per span: μs per executor action, μs per torch call of the
CPU platform layer (seq1f1b/runtime_overhead.py). One process, no model compute:

    python tools/span_overhead.py                      # seq1f1b, m=8, k=8
    python tools/span_overhead.py --schedule gpipe --splits 4

Times are for comparing versions of the code on one machine; the tool never asserts them.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from seq1f1b.plan import registry

    # one stage, one chunk, a chunk without split-backward linears
    names = [name for name in registry.names()
             if not registry.get(name).chunked and not registry.get(name).splits_backward]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="seq1f1b", choices=names)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--splits", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="best of this many iterations")
    args = parser.parse_args(argv)
    for flag in ("microbatches", "splits", "repeats"):
        if getattr(args, flag) < 1:
            print(f"--{flag} must be >= 1", file=sys.stderr)
            return 2

    import torch
    from seq1f1b.distributed import join_gloo_world
    from seq1f1b import runtime_overhead as overhead

    torch.set_num_threads(1)
    join_gloo_world()          # the CPU platform layer too, on a machine without CUDA
    per_action = overhead.executor_cost(args.schedule, args.microbatches, args.splits,
                                        repeats=args.repeats)
    print(f"executor: {per_action.schedule} P=1 m={args.microbatches} k={args.splits}, "
          f"{per_action.actions} actions: {per_action.wall_us:.1f} us/action wall, "
          f"{per_action.cpu_us:.1f} us/action CPU (best of {args.repeats})")
    for call, (shimmed, bare) in overhead.shim_cost(repeats=args.repeats).items():
        print(f"shim: {call:<28} {shimmed:6.2f} us/call with the platform layer, "
              f"{bare:6.2f} without (+{shimmed - bare:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

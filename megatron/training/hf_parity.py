"""Does the converted model compute what transformers computes? One forward pass, fp32.

The Hugging Face folder is converted to a release checkpoint (the converter's own path), loaded
into this rank's chunks at TP x PP (x V) with the trainer's loader, and run forward-only through
the asked pipeline schedule with its spans: the loss is what the schedule reports over PP micro-batches, the
logits are kept by the last stage's loss function, span by span, gathered over TP (megatron's
gather_from_tensor_model_parallel_region) and sent to rank 0. Rank 0 runs transformers' forward
(eager attention, fp32) on the same tokens and compares.

Threshold: fp32 rounds each operation at 2^-24 relative (6e-8); a forward pass of L layers sums
dot products of hidden-size terms in a different order than transformers does, which leaves
differences of order 1e-6 relative to the logits' scale in small models and grows slowly with depth
and width. `passed` asks for max |logit difference| <= 1e-4 x max(1, max |logit|) and the same
relative bound on the loss: far above fp32 rounding, far below what a misplaced head, a wrong
RoPE frequency or a swapped projection does (differences of the logits' own size).

It lives with the trainer, not in seq1f1b.hf: what it checks is that the trainer's loader
(checkpointing.load_model_weights) puts the converted weights where transformers has them.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist

from seq1f1b.hf import ConversionError

TOLERANCE = 1e-4


@dataclass
class ParityCase:
    """The flags of tools/hf_parity.py."""

    hf_dir: str
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    splits: int = 1
    schedule: str = "seq1f1b"
    seq_length: int = 32
    micro_batch_size: int = 2
    seed: int = 1234


@dataclass
class ParityResult:
    max_abs_logit_diff: float
    loss: float
    hf_loss: float
    passed: bool
    max_abs_logit: float
    case: dict


def check_case(case: ParityCase, world_size: int):
    """The folder's ModelSpec, after refusing (one line, naming the flag or file) what cannot
    run; collective-free, so every rank refuses alike before any work."""
    from seq1f1b.hf import config as hf_config
    from seq1f1b.runtime.forward_backward import MEGATRON_SCHEDULES, schedule_names
    from seq1f1b.equivalence import is_chunked

    check_batch_shape(case)
    _, spec = hf_config.read_spec(case.hf_dir)
    path = os.path.join(case.hf_dir, hf_config.CONFIG_FILE)
    hf_config.check_layout(spec, hf_config.Layout(case.tp, case.pp, case.vpp), path)
    if world_size != case.tp * case.pp:
        raise ConversionError(f"--tp {case.tp} x --pp {case.pp} is not the world size "
                              f"{world_size} (torchrun --nproc-per-node)")
    if case.schedule not in schedule_names():
        raise ConversionError(f"--schedule: unknown schedule {case.schedule!r}")
    if is_chunked(case.schedule) != (case.vpp > 1):
        raise ConversionError(f"--vpp {case.vpp} does not fit --schedule {case.schedule} "
                              f"(interleaved schedules need --vpp >= 2, the others 1)")
    if case.schedule in MEGATRON_SCHEDULES and case.splits != 1:
        raise ConversionError(f"--splits {case.splits}: {case.schedule} runs whole sequences")
    if not 1 <= case.splits <= case.seq_length:
        raise ConversionError(f"--splits must lie in 1 .. --seq-length {case.seq_length}")
    if spec.sliding_window is not None and case.seq_length > spec.sliding_window:
        raise ConversionError(f"--seq-length {case.seq_length} exceeds {path} sliding_window "
                              f"{spec.sliding_window}: Seq1F1B has no sliding window")
    return spec


def check_batch_shape(case: ParityCase) -> None:
    """--seq-length and --micro-batch-size below 1, refused first and each by its own name: the
    --splits range is read against --seq-length, and a batch of no rows divides by zero (or of
    negative rows fails as a tensor shape) inside the ranks."""
    from seq1f1b.model_flags import positive_error

    for flag, value in (("--seq-length", case.seq_length),
                        ("--micro-batch-size", case.micro_batch_size)):
        error = positive_error(flag, value)
        if error is not None:
            raise ConversionError(error)


def _tokens(case: ParityCase, spec) -> torch.Tensor:
    """[m x b, s + 1] random token ids of the model's vocabulary, the same on every rank: m =
    PP micro-batches (an interleaved schedule needs at least PP)."""
    gen = torch.Generator().manual_seed(case.seed)
    return torch.randint(0, spec.vocab_size,
                         (case.pp * case.micro_batch_size, case.seq_length + 1), generator=gen)


def _micro_batches(case: ParityCase, tokens: torch.Tensor) -> list[dict]:
    """The micro-batches of `tokens` on the device, each carrying its index (a [b] tensor,
    which the span cutter leaves whole)."""
    from seq1f1b import platform

    device, b = platform.compute_device(), case.micro_batch_size
    batches = []
    for index in range(tokens.shape[0] // b):
        rows = tokens[index * b:(index + 1) * b]
        batch = {"tokens": rows[:, :-1], "labels": rows[:, 1:],
                 "position_ids": torch.arange(case.seq_length).expand(b, -1),
                 "microbatch": torch.full((b,), index)}
        batches.append({key: value.to(device).contiguous() for key, value in batch.items()})
    return batches


def _convert(case: ParityCase, spec, folder: str) -> str:
    """Every rank converts (TP = PP = 1: data-parallel replicas, written once)."""
    from megatron.core import parallel_state

    from seq1f1b.distributed import release_model_parallel
    from seq1f1b.hf import checkpoint, weights
    from seq1f1b.hf.folder import read_hf_weights

    parallel_state.initialize_model_parallel(1, 1)
    try:
        tensors = weights.hf_to_megatron(spec, read_hf_weights(case.hf_dir, spec))
        return checkpoint.write_release(spec, tensors, case.hf_dir, folder)
    finally:
        release_model_parallel()


class _LogitKeeper:
    """The last stage's loss function: per-token loss from the TP-gathered logits of a span,
    which it keeps with the span's micro-batch and first position."""

    def __init__(self) -> None:
        self.spans: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward_step(self, data_iterator, model):
        import functools

        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None)
        return output, functools.partial(self.loss, batch["labels"], batch["microbatch"],
                                         batch["position_ids"])

    def loss(self, labels: torch.Tensor, microbatch: torch.Tensor, positions: torch.Tensor,
             logits: torch.Tensor):
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        full = gather_from_tensor_model_parallel_region(logits.contiguous()).float()
        self.spans.append((microbatch[0].detach(), positions[0, 0].detach(), full.detach()))
        losses = torch.nn.functional.cross_entropy(full.reshape(-1, full.shape[-1]),
                                                   labels.reshape(-1), reduction="none")
        count = torch.tensor(labels.numel(), dtype=torch.int, device=losses.device)
        total = losses.sum()
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    def logits(self) -> torch.Tensor:
        """[micro-batches x b, s, vocabulary]: spans joined along the sequence, micro-batches
        stacked in order."""
        ordered = sorted(self.spans, key=lambda item: (int(item[0]), int(item[1])))
        rows: dict[int, list[torch.Tensor]] = {}
        for microbatch, _, full in ordered:
            rows.setdefault(int(microbatch), []).append(full)
        return torch.cat([torch.cat(spans, dim=1) for _, spans in sorted(rows.items())])


def _pipelined(case: ParityCase, spec, release: str, tokens: torch.Tensor
               ) -> tuple[Optional[torch.Tensor], float]:
    """(logits on rank 0, else None; the schedule's loss) of the converted model at the case's
    layout."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron.training.checkpointing import load_model_weights
    from seq1f1b import platform
    from seq1f1b.distributed import release_model_parallel
    from seq1f1b.hf import checkpoint
    from seq1f1b.runtime.forward_backward import (SpanSettings, get_forward_backward_func,
                                                  splits_backward)

    chunked = case.vpp > 1
    parallel_state.initialize_model_parallel(
        case.tp, case.pp, virtual_pipeline_model_parallel_size=case.vpp if chunked else None)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(case.seed)
        config = checkpoint.transformer_config(spec, case.tp, case.pp, case.vpp, initialize=False)
        chunks = []
        for index in range(case.vpp):
            vp = index if chunked else None
            chunks.append(checkpoint.build_chunk(
                spec, config, vp_stage=vp, split_backward=splits_backward(case.schedule),
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                   vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                                   vp_stage=vp),
            ).to(platform.compute_device()).eval())
        load_model_weights(release, chunks)
        batches = _micro_batches(case, tokens)
        keeper = _LogitKeeper()
        with torch.no_grad():
            losses = get_forward_backward_func(case.schedule, SpanSettings(case.splits))(
                forward_step_func=keeper.forward_step,
                data_iterator=[iter(batches) for _ in chunks] if chunked else iter(batches),
                model=chunks if chunked else chunks[0], num_microbatches=len(batches),
                seq_length=case.seq_length, micro_batch_size=case.micro_batch_size,
                forward_only=True)
        device = platform.compute_device()
        shape = (tokens.shape[0], case.seq_length, spec.vocab_size)
        result = torch.zeros(shape[0] * shape[1] * shape[2] + 2, device=device)
        holds = bool(keeper.spans) and parallel_state.get_tensor_model_parallel_rank() == 0
        if holds:
            report = torch.stack([entry["lm loss"].float() for entry in losses]).sum(dim=0)
            result.copy_(torch.cat([keeper.logits().reshape(-1), report.reshape(-1)]))
        source = torch.tensor(dist.get_rank() if holds else -1, device=device)
        dist.all_reduce(source, op=dist.ReduceOp.MAX)     # the last stage's TP rank 0
        dist.broadcast(result, src=int(source))
        loss = float(result[-2] / result[-1])
        return (result[:-2].view(shape).cpu() if dist.get_rank() == 0 else None), loss
    finally:
        release_model_parallel()


def _transformers_forward(hf_dir: str, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(logits, mean next-token loss) of transformers' own model, eager attention, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))
    return logits, float(loss)


def run_parity(case: ParityCase) -> Optional[ParityResult]:
    """Collective over the default process group (world = TP x PP); the result on rank 0,
    None elsewhere. ConversionError for bad input, raised alike on every rank."""
    spec = check_case(case, dist.get_world_size())
    tokens = _tokens(case, spec)
    folder = [tempfile.mkdtemp(prefix="hf_parity_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    try:
        release = _convert(case, spec, folder[0])
        logits, loss = _pipelined(case, spec, release, tokens)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    if dist.get_rank() != 0:
        return None
    hf_logits, hf_loss = _transformers_forward(case.hf_dir, tokens)
    diff = float((logits - hf_logits).abs().max())
    scale = max(1.0, float(hf_logits.abs().max()))
    passed = diff <= TOLERANCE * scale and abs(loss - hf_loss) <= TOLERANCE * max(1.0, hf_loss)
    return ParityResult(diff, loss, hf_loss, passed, float(hf_logits.abs().max()), asdict(case))

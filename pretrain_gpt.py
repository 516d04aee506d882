"""Pretrain a GPT with Megatron-LM's flags and any pipeline schedule of Seq1F1B's registry.

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --pipeline-schedule seq1f1b --seq1f1b-splits 4 ...
    srun python pretrain_gpt.py ...            (rank and world from SLURM_PROCID / SLURM_NTASKS)

The three functions below are what a Megatron user writes (model provider, forward step with the
per-token loss, datasets provider); `megatron.training.training.pretrain` does the rest. Flags are
validated before megatron-core is imported, so a bad one is reported at once: one line on stderr,
exit code 2, nothing written. Module-level imports stay light on purpose (torch and
megatron-core are imported where they are used): validation then needs neither, and
megatron-core's checkpoint writer starts a `spawn` helper process that re-imports this file.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from megatron.training.global_vars import get_args, get_tokenizer

if TYPE_CHECKING:
    import torch


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None,
                   config=None) -> torch.nn.Module:
    """One GPT model chunk: megatron's GPTModel with Seq1F1B's span-aware attention, on the
    device (where Megatron-LM's get_model puts it: without a GPU the config initialises on the
    host, and megatron-core never moves a model)."""
    from seq1f1b.megatron_adapter import Architecture, build_model_chunk
    from seq1f1b.runtime.forward_backward import splits_backward

    args = get_args()
    return build_model_chunk(
        config, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, pre_process=pre_process,
        post_process=post_process, vp_stage=vp_stage, attention_backend=args.attention_backend,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        architecture=Architecture.from_args(args),
        split_backward=splits_backward(args.pipeline_schedule),
        reset_position_ids=args.reset_position_ids,
        spread_output=args.pipeline_spread_output)


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, pre_process: bool = True, post_process: bool = True,
              positions_on_every_stage: bool = False):
    """(tokens, labels, loss_mask, attention_mask, position_ids) of the next micro-batch (or the
    span of it the schedule runs); Nones on stages that read no data.

    The data loader collates on the host; the model computes on the device. As Megatron's
    get_batch_on_this_tp_rank, a stage moves only what it uses: the first stage
    (`pre_process`) its inputs, tokens and position_ids, the last stage (`post_process`) the
    loss's labels and loss_mask, any stage the attention mask when there is one (with packed
    documents every stage reads data: each attention needs the document ids), and every stage
    the position_ids when `positions_on_every_stage` (per-token RoPE, --reset-position-ids).
    """
    if data_iterator is None:
        return None, None, None, None, None
    from seq1f1b import platform

    batch = next(data_iterator)
    used = {"attention_mask"}
    if pre_process or positions_on_every_stage:
        used.add("position_ids")
    if pre_process:
        used.add("tokens")
    if post_process:
        used |= {"labels", "loss_mask"}
    device = platform.compute_device()
    return tuple(batch[key].to(device, non_blocking=True)
                 if key in used and batch.get(key) is not None else batch.get(key)
                 for key in _BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's per-token form: (sum of masked token losses, token count, report).

    The schedule divides by the micro-batch's token count over all of its spans (or by the
    global count with --calculate-per-token-loss), so splitting a sequence changes nothing.
    """
    import torch

    losses = output_tensor.float().reshape(-1)      # a span of a micro-batch: not contiguous
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """Megatron's forward step: run the chunk, hand back the loss function for the last stage."""
    from megatron.core.utils import get_attr_wrapped_model

    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, get_attr_wrapped_model(model, "pre_process"),
        get_attr_wrapped_model(model, "post_process"), get_args().reset_position_ids)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, functools.partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(num_samples):
    """megatron-core's GPT datasets (or mock data) for the ranks that feed a model chunk."""
    from megatron.training.data import DataConfig, build_datasets
    from megatron.training.training import is_dataset_built_on_rank

    return build_datasets(DataConfig.from_args(get_args()), get_tokenizer(), num_samples,
                          is_dataset_built_on_rank)


if __name__ == "__mp_main__":      # a helper a rank spawned (megatron-core's checkpoint writer)
    from megatron.training.exit_conditions import ignore_batch_signals

    ignore_batch_signals()

if __name__ == "__main__":
    from megatron.training.arguments import parse_and_validate_args
    from seq1f1b.import_notices import hide_import_notices

    arguments = parse_and_validate_args(None)
    hide_import_notices()
    from megatron.training.training import pretrain

    pretrain(arguments, train_valid_test_datasets_provider, model_provider, forward_step)

"""torchrun x2 worker: `decoder_seq_length` as the p2p tensor length, ours against megatron's 1F1B.

A two-stage toy in the shape of a language model fed image embeddings: stage 0 reads seq_length
text values per sample and sends [seq_length + IMAGE, b, h] (IMAGE learned positions in front);
stage 1 receives that and computes a loss. megatron-core sizes the p2p tensors with
decoder_seq_length = seq_length + IMAGE, so the same training step must run under ours at k=1 with
equal losses and grads, and be refused at k=2.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron_world import init_megatron  # noqa: E402

from seq1f1b.runtime.forward_backward import (SpanSettings,  # noqa: E402
                                              get_forward_backward_func)

SEQ, IMAGE, HIDDEN, BATCH, MICROBATCHES = 3, 2, 4, 2, 3


class Stage(torch.nn.Module):
    """Stage 0: text values -> [IMAGE + SEQ, b, h]; stage 1: that -> a scalar per sample."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=1,
                                        pipeline_model_parallel_size=2,
                                        pipeline_dtype=torch.float32)
        self.model_type = ModelType.encoder_or_decoder
        generator = torch.Generator().manual_seed(7 + int(first))
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, generator=generator))
        self.image = torch.nn.Parameter(torch.randn(IMAGE, 1, HIDDEN, generator=generator))
        self.input_tensor = None

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0]

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        if self.first:
            embedded = (text.t().unsqueeze(-1) * self.weight).tanh()        # [SEQ, b, h]
            image = self.image.expand(IMAGE, text.shape[0], HIDDEN)
            return torch.cat([image, embedded], dim=0)
        return (self.input_tensor * self.weight).sum(dim=(0, 2))            # [b]


def forward_step(data_iterator, model):
    text = next(data_iterator)

    def loss_func(output):
        loss = (output ** 2).mean()
        # A clone, as megatron's GPT loss_func does: megatron divides the loss by m in place,
        # which a detached view would follow.
        return loss, {"lm loss": loss.detach().clone()}

    return model(text), loss_func


def train_step(name: str, model: Stage, splits: int = 1) -> dict:
    model.zero_grad(set_to_none=True)
    data = torch.arange(MICROBATCHES * BATCH * SEQ, dtype=torch.float32).reshape(
        MICROBATCHES, BATCH, SEQ) / 10
    func = get_forward_backward_func(name, SpanSettings(splits=splits))
    losses = func(forward_step_func=forward_step, data_iterator=iter(data), model=[model],
                  num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=BATCH,
                  decoder_seq_length=SEQ + IMAGE, forward_only=False)
    return {"losses": [float(entry["lm loss"]) for entry in losses],
            "grads": [p.grad.clone() for p in model.parameters() if p.grad is not None]}


def main(cases_path: str, results_path: str) -> None:
    init_megatron(pipeline_model_parallel_size=2)
    model = Stage(first=parallel_state.get_pipeline_model_parallel_rank() == 0)
    theirs = train_step("megatron-1f1b", model)
    results = []
    for name in json.load(open(cases_path))[0]["schedules"]:
        ours = train_step(name, model)
        results.append({
            "schedule": name, "losses": ours["losses"], "megatron_losses": theirs["losses"],
            "grads_equal": len(ours["grads"]) == len(theirs["grads"]) > 0 and all(
                torch.equal(a, b) for a, b in zip(ours["grads"], theirs["grads"]))})
    try:
        train_step("seq1f1b", model, splits=2)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    results.append({"refusal_at_k2": refusal})
    dist.barrier()
    if dist.get_rank() == 0:
        gathered = [None, None]
        dist.gather_object(results, gathered, dst=0)
        json.dump([{"rank": r, "results": res} for r, res in enumerate(gathered)],
                  open(results_path, "w"))
    else:
        dist.gather_object(results, None, dst=0)
    # As the other workers do. Without it, rank 0 once aborted in a full suite run ("terminate
    # called without an active exception", SIGABRT; not reproduced in 15 runs alone), the
    # C++ message of a thread torn down still joinable, which the interpreter's exit can do
    # to a process group left alive.
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])

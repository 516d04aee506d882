"""The megatron side of a conversion: the whole model in one process, saved or loaded through
megatron-core's dist_checkpointing.

Sharded tensors are keyed by global tensor and global layer, so the release checkpoint written from
the whole model (TP = PP = 1) loads at any TP x PP x V, and a checkpoint of any training layout
loads into the whole model for export. Collective over the default process group (every rank
holds the whole model; the data-parallel replicas write nothing twice).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from seq1f1b import megatron_adapter
from seq1f1b.hf import ConversionError
from seq1f1b.hf.config import ModelSpec

RELEASE_FORMAT = "seq1f1b-hf-release-1"
RELEASE_HF_SUBDIR = "huggingface"     # config.json and tokenizer files of the source folder


def transformer_config(spec: ModelSpec, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                       initialize: bool = True, **overrides):
    """megatron's TransformerConfig of `spec` (fp32, no dropout) at a TP x PP (x V) layout;
    `overrides` go to TransformerConfig."""
    return megatron_adapter.make_transformer_config(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, ffn_hidden_size=spec.ffn_hidden_size,
        architecture=spec.architecture(), tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        perform_initialization=initialize, **overrides)


def build_chunk(spec: ModelSpec, config, *, pre_process: bool = True, post_process: bool = True,
                vp_stage: Optional[int] = None, split_backward: bool = False):
    """One GPTModel chunk of `spec` with Seq1F1B's span layer spec, as pretrain_gpt.py builds it."""
    return megatron_adapter.build_model_chunk(
        config, vocab_size=spec.vocab_size, max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope", pre_process=pre_process, post_process=post_process,
        vp_stage=vp_stage, share_embeddings_and_output_weights=spec.tie_word_embeddings,
        architecture=spec.architecture(), split_backward=split_backward)


def whole_model(spec: ModelSpec):
    """The whole model (parallel_state must be TP = PP = 1) in host memory, also on a GPU
    machine, left uninitialised: its weights come from a checkpoint."""
    return build_chunk(spec, transformer_config(spec, initialize=False,
                                                use_cpu_initialization=True))


def load_megatron_tensors(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the whole model's tensors (state-dict names) into `model`, strictly."""
    state = {name: value for name, value in model.state_dict().items()
             if name.endswith("_extra_state")}
    state.update(tensors)
    with torch.no_grad():
        model.load_state_dict(state, strict=True)


def save_release(model, folder: str, metadata: dict) -> None:
    """Write `model` as a release checkpoint into the empty `folder`; collective."""
    state = {"model": model.sharded_state_dict(), "checkpoint_version": 1,
             "release_format": RELEASE_FORMAT, "huggingface": metadata}
    dist_checkpointing.save(state, folder)


def _expected_shapes(model) -> dict[str, tuple[int, ...]]:
    """{sharded tensor key: global shape} of the model's sharded state dict (SwiGLU's FC1
    factory built into its pieces, which share one key)."""
    shapes = {}
    for entry in model.sharded_state_dict().values():
        for piece in entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]:
            if isinstance(piece, ShardedTensor):
                shapes[piece.key] = tuple(piece.global_shape)
    return shapes


def load_whole_model(spec: ModelSpec, folder: str):
    """The whole model with the weights of the checkpoint `folder` (any layout it was saved at);
    ConversionError naming the folder when its tensors do not fit `spec`."""
    model = whole_model(spec)
    try:
        stored = dist_checkpointing.load_tensors_metadata(folder)
    except Exception as err:    # megatron raises CheckpointingException and others
        raise ConversionError(f"{folder}: not a readable megatron checkpoint "
                              f"({' '.join(str(err).split())[:200]})") from None
    for key, shape in _expected_shapes(model).items():
        if key not in stored:
            raise ConversionError(f"{folder}: no tensor {key}; is it a checkpoint of this model?")
        if tuple(stored[key].global_shape) != shape:
            raise ConversionError(f"{folder}: {key} has shape {list(stored[key].global_shape)}, "
                                  f"the model of config.json has {list(shape)}")
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
    with torch.no_grad():
        model.load_state_dict(state["model"], strict=True)
    return model


def write_release(spec: ModelSpec, mg_tensors: dict[str, torch.Tensor], hf_dir: str,
                  save_dir: str) -> str:
    """Publish the whole model's tensors as `<save_dir>/release` (tracker `release`), with
    config.json and the tokenizer files of `hf_dir` in its `huggingface/` folder; collective,
    parallel_state at TP = PP = 1. Staged in a hidden folder, renamed when complete."""
    import torch.distributed as dist

    from seq1f1b import checkpoint_layout
    from seq1f1b.hf.folder import copy_companions

    model = whole_model(spec)
    load_megatron_tensors(model, mg_tensors)
    staging = os.path.join(save_dir, f".release.incomplete-{os.getpid()}")
    if dist.get_rank() == 0:
        os.makedirs(staging)
    names = [staging]
    dist.broadcast_object_list(names)      # rank 0's process id names the folder
    dist.barrier()
    save_release(model, names[0], {"hf_dir": os.path.abspath(hf_dir)})
    dist.barrier()
    if dist.get_rank() == 0:
        companions = os.path.join(names[0], RELEASE_HF_SUBDIR)
        os.makedirs(companions)
        copy_companions(hf_dir, companions, with_config=True)
        checkpoint_layout.publish_release(save_dir, names[0])
    dist.barrier()
    return checkpoint_layout.release_dir(save_dir)

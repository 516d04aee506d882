"""Hugging Face tensors <-> the state dict of the whole megatron model (TP = PP = 1).

Megatron's local layer spec fuses what Llama keeps apart: `linear_qkv` holds, per query group,
that group's query heads, then its key head, then its value head (rows [n/g*d | d | d] repeated g
times; the Qwen2 bias likewise), and SwiGLU's `linear_fc1` stacks gate_proj over up_proj. Both
RoPE conventions rotate the two halves of a head (no row permutation). Every other tensor is
renamed only. The maps are exact inverses: nothing is computed, only rows moved.
"""
from __future__ import annotations

import torch

from seq1f1b.hf import ConversionError
from seq1f1b.hf.config import ModelSpec

_EMBEDDING = ("model.embed_tokens.weight", "embedding.word_embeddings.weight")
_FINAL_NORM = ("model.norm.weight", "decoder.final_layernorm.weight")
_OUTPUT = ("lm_head.weight", "output_layer.weight")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)     # a buffer older checkpoints stored


def _renamed(spec: ModelSpec) -> list[tuple[str, str]]:
    """(Hugging Face name, megatron name) of the tensors that are only renamed."""
    pairs = [_EMBEDDING, _FINAL_NORM]
    if not spec.tie_word_embeddings:
        pairs.append(_OUTPUT)
    for i in range(spec.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        pairs += [(hf + "input_layernorm.weight", mg + "input_layernorm.weight"),
                  (hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight"),
                  (hf + "post_attention_layernorm.weight", mg + "pre_mlp_layernorm.weight"),
                  (hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight")]
    return pairs


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face folder of `spec` holds, with its shape."""
    h, f, v = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_query_groups * spec.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_hf_tensors(spec: ModelSpec, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse (naming `where`) tensors missing, unexpected or of the wrong shape for `spec`."""
    expected = hf_shapes(spec)
    present = {name: shape for name, shape in shapes.items()
               if not name.endswith(_IGNORED_SUFFIXES)
               and not (spec.tie_word_embeddings and name == _OUTPUT[0])}
    missing = sorted(set(expected) - set(present))
    if missing:
        raise ConversionError(f"{where}: missing tensor {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(set(present) - set(expected))
    if unexpected:
        raise ConversionError(f"{where}: unexpected tensor {unexpected[0]} for a "
                              f"{spec.family} model as config.json describes it")
    for name, shape in expected.items():
        if tuple(present[name]) != shape:
            raise ConversionError(f"{where}: {name} has shape {list(present[name])}, config.json "
                                  f"implies {list(shape)}")


def _fuse_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    groups, rest = spec.num_query_groups, q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(spec: ModelSpec, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    groups, d, rest = spec.num_query_groups, spec.head_dim, qkv.shape[1:]
    per_group = spec.num_attention_heads // groups * d
    q, k, v = qkv.reshape(groups, -1, *rest).split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def hf_to_megatron(spec: ModelSpec, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole megatron model's tensors (state-dict names) from checked Hugging Face ones."""
    out = {mg: hf[name] for name, mg in _renamed(spec)}
    for i in range(spec.num_layers):
        hf_attn, mg = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            out[mg + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                spec, *(hf[f"{hf_attn}{p}_proj.{kind}"] for p in "qkv"))
        mlp = f"model.layers.{i}.mlp."
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"],
                                                       hf[mlp + "up_proj.weight"]])
    return out


def megatron_to_hf(spec: ModelSpec, mg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (contiguous, unshared: what safetensors writes) from the whole
    megatron model's state dict."""
    out = {name: mg[key].contiguous() for name, key in _renamed(spec)}
    for i in range(spec.num_layers):
        hf_attn, prefix = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = _split_qkv(spec, mg[prefix + f"self_attention.linear_qkv.{kind}"])
            out.update({f"{hf_attn}q_proj.{kind}": q, f"{hf_attn}k_proj.{kind}": k,
                        f"{hf_attn}v_proj.{kind}": v})
        gate, up = mg[prefix + "mlp.linear_fc1.weight"].chunk(2)
        out[f"model.layers.{i}.mlp.gate_proj.weight"] = gate.contiguous()
        out[f"model.layers.{i}.mlp.up_proj.weight"] = up.contiguous()
    return out

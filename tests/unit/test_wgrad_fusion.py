"""Gradient accumulation fusion's pieces: the host kernel adds dY^T X into main_grad exactly as
dW followed by DDP's add, in main_grad's precision; without a kernel the fusion turns off with
one notice (a GPU without apex or Transformer Engine). The fused runs themselves are checked in
test_wgrad.py (B then W, DDP) and the equivalence matrix (every case but the UNFUSED ones)."""
import pytest
import torch
from megatron.core.tensor_parallel import layers

from seq1f1b.runtime import wgrad_fusion


def test_the_host_kernel_accumulates_dy_t_x_into_main_grad():
    gen = torch.Generator().manual_seed(0)
    x, dy = torch.randn(24, 8, generator=gen), torch.randn(24, 5, generator=gen)
    main_grad = torch.randn(5, 8, generator=gen)
    expected = main_grad + dy.t() @ x
    wgrad_fusion.HostWgradKernel.wgrad_gemm_accum_fp32(x, dy, main_grad)
    assert torch.allclose(main_grad, expected, rtol=1e-6, atol=1e-6)
    # bf16 activations, fp32 main_grad: products accumulated in fp32, as the CUDA kernel does
    fp32 = main_grad.clone()
    wgrad_fusion.HostWgradKernel.wgrad_gemm_accum_fp16(x.bfloat16(), dy.bfloat16(), main_grad)
    assert torch.allclose(main_grad, fp32 + dy.bfloat16().float().t() @ x.bfloat16().float(),
                          rtol=1e-6, atol=1e-5)


@pytest.mark.usefixtures("megatron_world")      # the CPU platform layer installs the kernel
def test_accumulate_hands_autograd_megatrons_dummy_gradient():
    weight = torch.nn.Parameter(torch.zeros(3, 4))
    weight.main_grad = torch.zeros(3, 4)
    x, dy = torch.ones(2, 4), torch.ones(2, 3)
    assert wgrad_fusion.accumulate(weight, x, dy) is None       # no DDP hook expects one
    assert torch.equal(weight.main_grad, torch.full((3, 4), 2.0))
    weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = True                                # shared with the embedding
    dummy = wgrad_fusion.accumulate(weight, x, dy)
    assert weight.grad_added_to_main_grad and torch.equal(dummy, torch.zeros(3, 4))
    assert torch.equal(weight.main_grad, torch.full((3, 4), 4.0))


def test_without_a_kernel_the_fusion_is_off_after_one_notice(monkeypatch):
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(wgrad_fusion, "_notified", False)
    notices = []
    assert wgrad_fusion.resolve(True, notices.append) is False
    assert wgrad_fusion.resolve(True, notices.append) is False
    assert wgrad_fusion.resolve(False, notices.append) is False
    assert notices == [wgrad_fusion.NOTICE]
    assert "--no-gradient-accumulation-fusion" in notices[0]


@pytest.mark.usefixtures("megatron_world")
def test_the_cpu_platform_layer_provides_the_kernel():
    assert wgrad_fusion.available()
    assert wgrad_fusion.resolve(True, pytest.fail) is True


def test_the_flag_is_megatrons():
    from megatron.training.arguments import parse_args
    assert parse_args([]).gradient_accumulation_fusion is True
    assert parse_args(["--no-gradient-accumulation-fusion"]).gradient_accumulation_fusion is False


@pytest.mark.usefixtures("megatron_world")
def test_a_fused_backward_under_saved_tensor_hooks_reports_every_gradient_to_ddp():
    """The CPU trainer meters saved tensors in every iteration, and under saved-tensor hooks the
    weight a linear's backward unpacks has lost its Python attributes: the fused path must still
    hand DDP's hook a gradient (with overlap_grad_reduce it refuses none) and sum exactly."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from seq1f1b.megatron_adapter import build_model_chunk, make_transformer_config
    from seq1f1b.runtime.memory import SavedTensorMeter

    def stage(fusion: bool, overlap: bool):
        config = make_transformer_config(num_layers=1, hidden_size=16, num_attention_heads=2,
                                         gradient_accumulation_fusion=fusion)
        torch.manual_seed(0)
        model = build_model_chunk(config, vocab_size=32, max_sequence_length=8,
                                  share_embeddings_and_output_weights=False)
        return DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap), model)

    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand(2, 8)
    grads = []
    for model in (stage(False, False), stage(True, True)):
        with SavedTensorMeter():
            model(tokens, positions, None, labels=tokens).sum().backward()
        model.finish_grad_sync()
        grads.append({name: param.main_grad.clone() for name, param in model.named_parameters()})
    unfused, fused = grads
    assert set(unfused) == set(fused)
    for name in unfused:
        assert torch.allclose(fused[name], unfused[name], rtol=1e-5, atol=1e-6), name

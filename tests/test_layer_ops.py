"""The C add+RMSNorm and RoPE (native/csrc/layer_ops.c) against the torch forms they replace."""
import pytest
import torch

from everybyte.models import layers, native_ops
from everybyte.models.layers import RMSNorm
from everybyte.models.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not native_ops.available(), reason="no C compiler")


def _torch_rope(rot, pos, x):
    cos, sin = rot.cos_sin[pos].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rope_kernel_is_bit_exact_on_strided_qkv_rows(tokens):
    g = torch.Generator().manual_seed(tokens)
    rot = RotaryEmbedding(64, 4096, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    qkv = torch.randn(tokens, 15 * 64, generator=g)
    q, k = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    assert rot._fusable(pos, q, k)
    fq, fk = rot(pos, q, k)
    assert fq.is_contiguous() and torch.equal(fq, _torch_rope(rot, pos, q)) and torch.equal(fk, _torch_rope(rot, pos, k))


def test_rope_falls_back_to_torch_when_the_kernel_cannot_take_it():
    rot = RotaryEmbedding(64, 128, 10000.0, None)
    q, k = torch.randn(4, 9, 64), torch.randn(4, 3, 64)
    assert not rot._fusable(torch.tensor([0, 1, 2, 500]), q, k)          # past the table: torch raises
    with pytest.raises(IndexError):
        rot(torch.tensor([0, 1, 2, 500]), q, k)
    assert not rot._fusable(torch.arange(4), q.bfloat16(), k.bfloat16())
    out = rot(torch.arange(4), q.bfloat16(), k.bfloat16())[0]
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 5, 2048])
def test_add_rmsnorm_kernel_matches_torch(rows):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data = torch.randn(576, generator=g)
    x, r = torch.randn(rows, 576, generator=g) * 3, torch.randn(rows, 576, generator=g)
    assert layers._fused(x, r, norm.weight)
    h = x + r
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    residual = r.clone()
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert new_residual is residual and torch.equal(residual, h)            # updated in place
    torch.testing.assert_close(norm(x), norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)),
                               atol=1e-5, rtol=1e-5)
    assert not layers._fused(x.view(rows, 9, 64), None, norm.weight)       # 3-D (q/k norms): torch


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_mul_kernel_matches_torch(rows):
    from everybyte.models import native_ops
    if native_ops.lib() is None:
        pytest.skip("no model-op kernels")
    g = torch.Generator().manual_seed(rows)
    gu = torch.randn(rows, 2 * 1536, generator=g) * 4
    gate, up = gu.chunk(2, dim=-1)
    got = native_ops.silu_mul(gu)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert native_ops.silu_mul(gu.to(torch.bfloat16)) is None             # not float32: the caller's torch path


@pytest.mark.parametrize("shape", [(1, 3, 64), (32, 3, 64), (4, 2, 128)])
def test_rotation_kernel_matches_matmul(shape):
    from everybyte.formats.kv_layout import hadamard
    from everybyte.models import native_ops
    if native_ops.lib() is None:
        pytest.skip("no model-op kernels")
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
    h = hadamard(shape[-1], torch.float32, "cpu")
    torch.testing.assert_close(native_ops.rotate_rows(x, h), x @ h, rtol=1e-5, atol=1e-5)

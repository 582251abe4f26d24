import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from everybyte.models import gemm


@pytest.mark.skipif(not gemm.onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (32, 576, 3072), (300, 1536, 576), (7, 64, 49)])
def test_onednn_linear_matches_torch(m, k, n):
    g = torch.Generator().manual_seed(m * n)
    x, w, b = (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5,
               torch.randn(n, generator=g))
    torch.testing.assert_close(gemm.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_other_dtypes_and_shapes_take_torch():
    x, w = torch.randn(2, 3, 8, dtype=torch.float32), torch.randn(5, 8)
    assert torch.equal(gemm.linear(x, w), F.linear(x, w))
    xb, wb = x[0].bfloat16(), w.bfloat16()
    assert torch.equal(gemm.linear(xb, wb), F.linear(xb, wb))


def test_unknown_backend_is_a_clear_error():
    env = dict(os.environ, EVERYBYTE_GEMM="blas")
    r = subprocess.run([sys.executable, "-c", "import everybyte.models.gemm"], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "EVERYBYTE_GEMM='blas'" in r.stderr and "onednn, mkl" in r.stderr

"""The device-driven exchange's kernels (`asynchronous.chain_kernels`) against their PyTorch steps and the wire.

On a GPU they run as compiled; on CPU through Triton's interpreter (`TRITON_INTERPRET=1`, in a process of its own:
the variable is read when the kernels are defined), so their flag and header logic is checked without a GPU.
The interpreter has no bf16 of its own, so its bf16 rows may differ from PyTorch's rounding by one unit in the last
place: there, and only there, rows are compared within that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import chain_kernels

TESTS_DIR = Path(__file__).resolve().parents[1]  # the child imports helpers.chain_kernels from here


def _interpreted(check: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), *sys.path])}
    code = f"from helpers import chain_kernels as t; t.{check}('cpu'); print('passed')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "passed" in done.stdout, done.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", ["check_ffn_kernels", "check_send_kernel"])
def test_kernels_interpreted_on_cpu(check: str) -> None:
    _interpreted(check)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", ["check_ffn_kernels", "check_send_kernel"])
def test_kernels_on_the_gpu(check: str) -> None:
    getattr(chain_kernels, check)("cuda")

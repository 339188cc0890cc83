"""Kernel tests run the Triton kernels through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time.

Every test starts from the same state of torch's global generator: tests that draw from it (an upstream
gradient from ``torch.randn_like``) then see the same numbers whichever tests ran before them in the process,
which under xdist depends on how the workers happened to share out the tests.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def same_global_generator():
    torch.manual_seed(0)

"""Kernel tests run the Triton kernels through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection time.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

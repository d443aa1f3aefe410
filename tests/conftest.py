"""Shared test setup."""

import os

import torch

# Without a GPU the Triton kernels run under Triton's interpreter, which is chosen when a kernel
# is decorated: the flag has to be set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""oneDNN's cache of compiled CPU kernels is capped before lit_cancel's first model arithmetic, unless the user set it."""

import os
import subprocess
import sys

import pytest
from transformers import AutoConfig

from lit_cancel import RLModule
from lit_cancel.host_memory import KERNEL_CACHE_VARIABLE
from lit_cancel.run.precision import cpu_bf16_speedup

# three convolutions of different shapes, then the first again: a cache of two kernels has evicted it by then
CONVOLUTIONS = """
import sys
import torch
from lit_cancel.host_memory import bound_kernel_cache
if sys.argv[1] == "bounded":
    assert bound_kernel_cache(capacity=2)
for size in (64, 72, 80, 64):
    torch.nn.functional.conv2d(torch.ones(1, 4, size, size), torch.ones(4, 4, 3, 3))
"""


def kernel_creations(mode: str) -> list[str]:
    """oneDNN's record of each kernel it built or found in its cache while running CONVOLUTIONS."""
    env = {name: value for name, value in os.environ.items() if name != KERNEL_CACHE_VARIABLE}
    env["ONEDNN_VERBOSE"] = "profile_create"
    done = subprocess.run([sys.executable, "-c", CONVOLUTIONS, mode], env=env, capture_output=True, text=True, check=True)
    return [field for line in done.stdout.splitlines() for field in line.split(",") if field.startswith("create:cache_")]


def test_a_bounded_cache_evicts_the_kernels_an_unbounded_one_finds_again():
    unbounded = kernel_creations("default")
    if not unbounded:
        pytest.skip("this torch runs these convolutions without oneDNN")
    assert "create:cache_hit" in unbounded  # the default cache (1,024 kernels) still holds the first shape's
    bounded = kernel_creations("bounded")
    assert bounded and set(bounded) == {"create:cache_miss"}


def test_the_module_and_auto_precision_cap_the_cache_unless_the_variable_is_set(tiny_model_path, monkeypatch):
    monkeypatch.delenv(KERNEL_CACHE_VARIABLE, raising=False)
    RLModule(tiny_model_path)
    assert os.environ[KERNEL_CACHE_VARIABLE] == "64"

    monkeypatch.delenv(KERNEL_CACHE_VARIABLE)
    cpu_bf16_speedup(AutoConfig.from_pretrained(tiny_model_path), repeats=1)
    assert os.environ[KERNEL_CACHE_VARIABLE] == "64"

    monkeypatch.setenv(KERNEL_CACHE_VARIABLE, "512")
    RLModule(tiny_model_path)
    cpu_bf16_speedup(AutoConfig.from_pretrained(tiny_model_path), repeats=1)
    assert os.environ[KERNEL_CACHE_VARIABLE] == "512"

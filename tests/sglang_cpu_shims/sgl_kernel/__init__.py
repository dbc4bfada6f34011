"""TEST SUPPORT ONLY: a pure-torch stand-in for `sgl_kernel` (SGLang's CUDA kernel package) for
colo_rl's SGLang-on-CPU tests (tests/sglang_cpu_shims/colo_rl_sglang_cpu_shim.py says why).

It provides the one function SGLang 0.5.21's CPU path calls for a dense model; every other name
imports but raises NotImplementedError naming it when called, so a new call shows up as a loud failure, not a wrong result.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+colo_rl-test-shim"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next end[i] - start[i]
    entries of out_cache_loc (requests back to back), as SGLang's triton kernel does."""
    offset = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def __getattr__(name: str):
    """Any other kernel: importable (SGLang imports some at module level, e.g.
    copy_all_layer_kv_cache_cpu), but calling it raises."""
    if name.startswith("__"):  # import machinery probes (__path__, __file__, ...)
        raise AttributeError(name)

    def not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: colo_rl's CPU test stand-in for sgl_kernel (tests/sglang_cpu_shims/) implements "
            "only assign_req_to_token_pool_cpu, and SGLang now calls another kernel on CPU: add a pure-torch "
            "version there")

    not_implemented.__name__ = name
    return not_implemented

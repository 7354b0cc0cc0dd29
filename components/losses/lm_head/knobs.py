"""Launch knobs of the gradient-in-forward row kernels, shared by the schedule (fwdgrad.py) and
its Triton kernels (triton_fwdgrad.py).

``benchmarks/loss_bench.py --fwdgrad-block/--fwdgrad-warps/--fwdgrad-streams`` sweep them: the
row kernel's columns per step and warps; ``streams=2`` runs chunk i's dH/dW GEMMs on a side
stream while chunk i+1's logits GEMM and row kernel run (two logits buffers, CUDA only, not
under a vocabulary group). ``fwdgrad.KERNEL`` is this same dict.
"""

KERNEL = {"block": 4096, "num_warps": 8, "streams": 1}  # tuned on an H200 (docs/skills/linear_ce.md)


def chunk_tokens_for(n: int, chunk_tokens: int) -> int:
    """Tokens per logits chunk for ``n`` tokens (the planner sizes the chunk with it, without torch)."""
    return max(1, min(int(chunk_tokens), n))

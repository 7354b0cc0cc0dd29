"""The fused LM head: per-token statistics and gradients of ``hidden @ weight^T`` without a
[tokens, vocab] tensor, shared by linear_ce, logprob and the policy losses.

* ``engine``: the recompute-in-backward engine (backends torch / triton / cublas / mixed);
* ``triton_kernels``: its Triton kernels (CUDA or TRITON_INTERPRET=1 only);
* ``fwdgrad``: the gradient-in-forward schedule (backend fwdgrad);
* ``triton_fwdgrad``: its Triton row kernels; ``knobs``: their launch knobs;
* ``head_loss``: the trainer side (a torchtitan ChunkedLossWrapper whose loss owns lm_head).
* ``linear_ce_fn``: ``linear_cross_entropy`` and its autograd Functions (loss=linear_ce's function).
"""

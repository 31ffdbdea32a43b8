"""Triton kernels for the latent ops.

Empty in this release: every op in ``lrkv_compile.lowering.ops`` runs its PyTorch reference
implementation. The fused Triton kernels (reconstruct + RoPE + q.K with online softmax, p.V' in
the latent space) are planned next and will be selected by ``lowering`` when a GPU is present.
"""

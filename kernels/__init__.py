"""Triton kernels for the latent ops (the pure `@triton.jit` code; launch geometries live with the launcher).

`latent_decode`: decode attention (one new token per sequence) over a latent cache, 16-bit or quantized, in
the byte layout `lowering/quantize.py` documents; `latent_tiles`: reading one tile of that layout. Launched
by `lowering/triton_decode.py` (which the compiled model's `latent_attention` op calls on CUDA decode steps),
checked against the reference op by `tests/test_kernels.py` (on CPU under Triton's interpreter, and on a GPU).
`gluon_far`: the budget plan's far loop in Triton's Gluon dialect, which the decode launcher gives a windowed step's
far slots (`lowering/gluon_far.py`); GPU only.
"""

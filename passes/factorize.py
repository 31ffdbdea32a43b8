"""Activation-aware low-rank factorization of K/V projection weights (SVD-LLM whitening, Palu schemes).

For a projection y = x W^T with input Gram G = E[x^T x] = S S^T (Cholesky), the rank-r W' that
minimises E||x (W - W')^T||^2 is W' = U_r S_r V_r^T S^-1 where W S = U S V^T (SVD-LLM, Thm. 1).
We store it as y' = (x down) up with down = S^-T V_r S_r and up = U_r^T: `up` has orthonormal rows, so
an error in a latent (quantization) reaches the keys/values with the same norm instead of being scaled
by the singular values, and uniform quantization spends its bits where the output needs them.
Schemes split the output channels into `groups` independent blocks (Palu: M-LRD = one block per
head, G-LRD = one per group of heads, J-LRD = one block); `up` is then block diagonal.
"""
import torch

SCHEMES = ("head", "group", "joint")


def blocks_for(scheme: str, num_kv_heads: int, group_size: int) -> int:
    """Number of independent factor blocks a scheme gives."""
    if scheme == "head":
        return num_kv_heads
    if scheme == "joint":
        return 1
    if scheme == "group":
        if group_size < 1 or num_kv_heads % group_size:
            raise ValueError(f"group_size={group_size} does not divide num_kv_heads={num_kv_heads}")
        return num_kv_heads // group_size
    raise ValueError(f"unknown decomposition scheme {scheme!r}; choose one of {SCHEMES}")


def whitening_factor(gram: torch.Tensor) -> torch.Tensor:
    """Lower-triangular S with S S^T = gram (+ the smallest diagonal damping that makes it positive definite)."""
    gram = gram.double()
    gram = (gram + gram.T) / 2
    damping = 0.0
    base = gram.diagonal().mean().clamp_min(1e-12)
    for _ in range(12):
        factor, info = torch.linalg.cholesky_ex(gram + damping * torch.eye(len(gram), dtype=gram.dtype))
        if int(info) == 0:
            return factor
        damping = base * (1e-6 if damping == 0.0 else damping / base * 10)
    raise RuntimeError("calibration Gram matrix is not positive definite even with damping; calibrate on more tokens")


def spectrum(weight: torch.Tensor, whitening: torch.Tensor | None, blocks: int):
    """Each block's (whitened) SVD, once for every rank: (u [blocks, block_out, m], s [blocks, m], v [blocks, in, m])
    with v = S^-T V (V itself without whitening), m = min(block_out, in). `truncate` cuts factors from it.

    whitening: S from `whitening_factor`, or None for plain SVD (an uncalibrated plan).
    """
    w = weight.double().reshape(blocks, weight.shape[0] // blocks, -1)
    u, s, vh = torch.linalg.svd(w @ whitening if whitening is not None else w, full_matrices=False)
    v = vh.transpose(1, 2)
    if whitening is not None:
        v = torch.linalg.solve_triangular(whitening.T, v, upper=True)
    return u, s, v


def truncate(factors, rank: int):
    """down [in, rank] and block-diagonal up [rank, out] of rank `rank` (split evenly over the blocks) from a
    `spectrum`."""
    u, s, v = factors
    blocks, block_out, largest = u.shape
    if rank % blocks:
        raise ValueError(f"rank {rank} is not divisible into {blocks} blocks")
    block_rank = rank // blocks
    if block_rank > largest:
        raise ValueError(f"rank {block_rank} per block exceeds the block's size {largest}")
    down = (v[:, :, :block_rank] * s[:, None, :block_rank]).permute(1, 0, 2).reshape(v.shape[1], rank)
    up = torch.block_diag(*u[:, :, :block_rank].transpose(1, 2))
    return down.float(), up.float()


def factorize(weight: torch.Tensor, whitening: torch.Tensor | None, blocks: int, rank: int):
    """Factor weight [out, in] into down [in, rank] and block-diagonal up [rank, out], rank split evenly over
    blocks. whitening: S from `whitening_factor`, or None for plain SVD (an uncalibrated plan)."""
    return truncate(spectrum(weight, whitening, blocks), rank)


ROTATIONS = ("none", "hadamard", "orthogonal")


def _random_orthogonal(size: int, generator: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(size, size, dtype=torch.float64, generator=generator))
    return (q * torch.sign(torch.diagonal(r))).contiguous()  # Haar-distributed


def rotation(kind: str, size: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal [size, size] matrix (float64), fixed by `seed`.

    "hadamard": H_(2^k) (x) Q_m times random signs, where size = 2^k * m with m odd: a Sylvester Hadamard
    over the power-of-two factor and a random orthogonal Q over the odd one (identity when m = 1), so any
    size works and power-of-two sizes get a plain randomized Hadamard. "orthogonal": a random one.
    """
    if kind not in ROTATIONS:
        raise ValueError(f"unknown rotation {kind!r}; choose one of {ROTATIONS}")
    if kind == "none":
        return torch.eye(size, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed * 7919 + size)
    if kind == "orthogonal":
        return _random_orthogonal(size, generator)
    power = size & -size  # largest power of two dividing size
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < power:
        hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)), 0)
    odd = size // power
    odd_part = _random_orthogonal(odd, generator) if odd > 1 else torch.eye(1, dtype=torch.float64)
    mixed = torch.kron(hadamard / power ** 0.5, odd_part)
    signs = torch.randint(0, 2, (size,), generator=generator, dtype=torch.float64) * 2 - 1
    return mixed * signs


def rotate(down: torch.Tensor, up: torch.Tensor, kind: str, blocks: int, seed: int = 0, keep: int = 0):
    """Fuse a rotation R into the factors: (x down R)(R^T up) = x down up, with R block diagonal over the
    scheme's blocks so a head-wise plan stays head-wise. Spreads outlier channels before quantization
    (RotateKV / QuaRot); exact before quantization. The first `keep` channels (one block only: the largest
    singular directions, stored unquantized) are left as they are."""
    block = down.shape[1] // blocks
    if keep and blocks != 1:
        raise ValueError(f"keeping {keep} leading channels out of the rotation needs one block, not {blocks}")
    matrix = torch.block_diag(*(rotation(kind, block - keep, seed * blocks + index) for index in range(blocks)))
    if keep:
        matrix = torch.block_diag(torch.eye(keep, dtype=matrix.dtype), matrix)
    return (down.double() @ matrix).float(), (matrix.T @ up.double()).float()

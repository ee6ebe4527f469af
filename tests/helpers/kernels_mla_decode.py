"""Cases and the eager reference of the MLA decode kernel, shared by its CPU and GPU tests."""

from __future__ import annotations

import torch


def eager_o_latent(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache_layer: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    *,
    upcast: bool = False,
) -> torch.Tensor:
    """The einsum path of `MLAttention._decode_attention` (gather, then einsums) up to `probs . kv_c` [B, nh, C];
    `upcast` runs it in fp32 from the same inputs (the reference for bf16)."""
    C = q_latent.shape[-1]
    context = cache_layer[rows]  # [B, L, C + R]
    if upcast:
        q_latent, q_pe, context = q_latent.float(), q_pe.float(), context.float()
    kv_c, k_pe = context.split([C, context.shape[-1] - C], dim=-1)
    scores = torch.einsum("bhc,blc->bhl", q_latent, kv_c) + torch.einsum("bhr,blr->bhl", q_pe, k_pe)
    scores = scores.float().mul_(scale).masked_fill_(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv_c.dtype)  # [B, nh, L]
    return torch.einsum("bhl,blc->bhc", probs, kv_c)  # [B, nh, C]


def make_case(
    B: int,
    L: int,
    nh: int,
    C: int,
    R: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    block_size: int = 16,
    padded: int = 0,
    full: bool = False,
    q_std: float = 1.0,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(q_latent [B, nh, C], q_pe [B, nh, R], cache_layer [rows, C + R], rows [B, L], valid [B, L]).

    Block 0 is the all-zero null block; each sequence's blocks are scattered over the pool. Sequence 0 has
    all L rows, the others random lengths (all L when `full`); the last `padded` sequences are laid out as
    the CUDA-graph runner pads a batch: valid only at column 0, every row the null block's first row.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    kw = {"device": device, "generator": g}
    nblk = -(-L // block_size)
    pool_blocks = 1 + B * nblk
    cache_layer = torch.randn(pool_blocks * block_size, C + R, **kw)
    cache_layer[:block_size] = 0
    tables = (torch.randperm(B * nblk, **kw) + 1).view(B, nblk)  # [B, nblk]
    offsets = torch.arange(block_size, device=device)
    rows = (tables[:, :, None] * block_size + offsets).reshape(B, nblk * block_size)[:, :L]  # [B, L]
    lengths = torch.full((B,), L, device=device) if full else torch.randint(1, L + 1, (B,), **kw)
    lengths[0] = L
    if padded:
        lengths[B - padded :] = 1
    valid = torch.arange(L, device=device)[None, :] < lengths[:, None]  # [B, L]
    rows = rows.masked_fill(~valid, 0)
    if padded:
        rows[B - padded :] = 0
    q_latent = torch.randn(B, nh, C, **kw) * q_std
    q_pe = torch.randn(B, nh, R, **kw) * q_std
    return q_latent.to(dtype), q_pe.to(dtype), cache_layer.to(dtype), rows, valid


def lengths(valid: torch.Tensor) -> torch.Tensor:
    """[B] int32 context lengths of a prefix `valid` [B, L], the kernel's `lens`."""
    return valid.sum(1, dtype=torch.int32)


def make_ragged_case(
    lens: list[int],
    nh: int,
    C: int,
    R: int,
    *,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    poison: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(q_latent, q_pe, cache_layer, table [B, W] of blocks of `block_size` rows, lens [B] int32, rows [B, L],
    valid [B, L]) for one batch whose sequences have the context lengths `lens`: each sequence's blocks scattered
    over the pool, the table as wide as the longest sequence needs (its unused entries: a block nobody owns),
    `rows`/`valid` the same contexts per position for the reference. `poison`: every cache row no sequence owns
    within its length (the tails of last blocks, the unowned blocks) holds NaN; the null block stays zero."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = {"device": device, "generator": g}
    B = len(lens)
    nblks = [-(-n // block_size) for n in lens]
    W = max(nblks)
    pool_blocks = 1 + sum(nblks) + 3  # three blocks nobody owns
    cache_layer = torch.randn(pool_blocks * block_size, C + R, **kw)
    cache_layer[:block_size] = 0
    order = (torch.randperm(pool_blocks - 1, **kw) + 1).tolist()
    spare = order[-1]  # a block nobody owns: the table's unused entries point at it
    table = torch.full((B, W), spare, dtype=torch.int64, device=device)
    owned = torch.zeros(pool_blocks * block_size, dtype=torch.bool, device=device)
    for b, (n, k) in enumerate(zip(lens, nblks, strict=True)):
        blocks, order = order[:k], order[k:]
        table[b, :k] = torch.tensor(blocks, device=device)
        for p in range(n):
            owned[blocks[p // block_size] * block_size + p % block_size] = True
    if poison:
        owned[:block_size] = True  # the null block stays zero: the reference reads it for padding
        cache_layer[~owned] = float("nan")
    L = W * block_size
    offsets = torch.arange(block_size, device=device)
    rows = (table[:, :, None] * block_size + offsets).reshape(B, L)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    valid = torch.arange(L, device=device)[None, :] < lens_t[:, None]
    rows = rows.masked_fill(~valid, 0)
    q_latent = torch.randn(B, nh, C, **kw)
    q_pe = torch.randn(B, nh, R, **kw)
    cast = cache_layer.to(dtype)
    return q_latent.to(dtype), q_pe.to(dtype), cast, table, lens_t, rows, valid

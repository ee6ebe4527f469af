"""Paged MLA latent cache: one pool of fixed-size blocks per layer, block tables on the device.

Why paged: one buffer per (sequence, layer) meant a `pad_sequence` copy of every decoding sequence's
cache in every layer, and a pool sized per request cannot say in advance whether the next request fits.
Here the whole cache is one tensor `[num_layers, (num_blocks + 1) * block_size, C + R]` (C =
`kv_lora_rank`, R = `qk_rope_head_dim`: the normalized latent and the roped key, never expanded keys or
values), allocated once. A sequence reserves the blocks for everything it will ever cache at admission
(prompt + max_new_tokens - 1 tokens), so a running sequence never needs more and nothing is ever
preempted; a request that does not fit waits in the queue until blocks free up.

Block 0 is the null block: never handed out, kept zero. Padding positions of a batched read point at
its first row, so a padded context reads zeros exactly as `pad_sequence` padded it (uninitialized rows
could hold NaN, and `0 * NaN` would leak through the masked softmax).

Per step, `prepare` turns the host-side batch description into device tensors with one host->device
copy: the slot mapping (token -> flat cache row, written by one `index_copy_` per layer), the batched
decodes' block-table rows and context lengths (the decode kernel walks each sequence's own length, never
the longest one's), the rows of every other context a layer gathers (built on the device from the block
tables), and any pending block-table rows of newly admitted sequences.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from afd.model.batch import Batch
    from afd.model.config import ModelConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
NULL_BLOCK = 0
DEFAULT_BLOCK_SIZE = 16  # vLLM's default on CUDA
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default: the fraction of the GPU's memory this process may use
# On CPU the cache is a plain budget, vLLM's CPU backend default (VLLM_CPU_KVCACHE_SPACE=4). The pool is
# allocated uninitialized, so only pages of blocks that were handed out become resident.
DEFAULT_CPU_CACHE_BYTES = 4 * GiB


@dataclass(frozen=True)
class CacheOptions:
    """How an engine sizes its KV cache; named after vLLM's flags (`--block-size`,
    `--gpu-memory-utilization`, `--num-gpu-blocks-override`, `--max-num-seqs`)."""

    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    num_blocks: int | None = None  # a fixed pool instead of sizing from memory (any device)
    max_num_seqs: int = 256

    def engine_kwargs(self) -> dict:
        return asdict(self)

    def shared_by(self, ranks_on_gpu: int) -> CacheOptions:
        """The share of a GPU one of `ranks_on_gpu` co-located ranks may take (the others load after it)."""
        return replace(self, gpu_memory_utilization=self.gpu_memory_utilization / max(1, ranks_on_gpu))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def latent_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token takes in the cache, over all layers: one latent of C + R values per layer."""
    width = config.kv_lora_rank + config.qk_rope_head_dim
    return width * config.num_hidden_layers * dtype.itemsize


def activation_bytes_estimate(config: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int) -> int:
    """An upper estimate of the activation peak of one step of `max_num_batched_tokens` tokens.

    Estimated, not measured: attention ranks cannot run a dummy forward before their peers are up (every
    boundary layer is an exchange). Per token: a few hidden-size rows, q and the expanded prefill keys
    and values, the larger of the dense MLP and the routed + shared expert intermediates, the gathered
    expert rows with their fp32 accumulators, and fp32 logits with their log-softmax over the whole
    vocabulary (prompt logprobs score every prompt position).
    """
    c = config
    item = dtype.itemsize
    heads = c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
    mlp = max(c.intermediate_size, (c.num_experts_per_tok + c.n_shared_experts) * c.moe_intermediate_size)
    model_dtype = 8 * c.hidden_size + 4 * heads + 3 * mlp + 2 * c.num_experts_per_tok * c.hidden_size
    fp32 = 4 * c.hidden_size + 2 * c.vocab_size
    return max_num_batched_tokens * (model_dtype * item + fp32 * 4)


@dataclass(frozen=True)
class DeviceMemory:
    """What the GPU reported when the cache was sized (bytes)."""

    total: int
    free: int
    this_process: int  # already held by this process's allocator: the weights, mostly


def num_cache_blocks(
    *,
    block_size: int,
    bytes_per_token: int,
    max_useful_tokens: int,
    max_cache_tokens: int | None = None,
    memory: DeviceMemory | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_bytes: int = 0,
    cpu_cache_bytes: int = DEFAULT_CPU_CACHE_BYTES,
) -> int:
    """How many blocks (besides the null block) the pool gets; a pure function of the numbers given.

    - `max_cache_tokens` given: that many tokens, rounded down to whole blocks (any device).
    - `memory` given (CUDA): as vLLM, this process may use `gpu_memory_utilization` of the GPU's total
      memory; the cache gets what the weights (`memory.this_process`) and the activation peak leave of
      it, and never more than is free now minus that peak (other processes may share the GPU).
    - otherwise (CPU): `cpu_cache_bytes`.
    A byte budget is never turned into more than `max_useful_tokens` (max_num_seqs x max model length):
    more could never be used.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if max_cache_tokens is not None:
        blocks = max_cache_tokens // block_size
        if blocks < 1:
            raise ValueError(
                f"max_cache_tokens {max_cache_tokens} is less than one block of {block_size} tokens; raise it"
            )
        return blocks
    block_bytes = block_size * bytes_per_token
    if memory is not None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        allowed = int(memory.total * gpu_memory_utilization) - memory.this_process - activation_bytes
        budget = min(allowed, memory.free - activation_bytes)
        if budget < 2 * block_bytes:  # the null block and at least one usable block
            raise ValueError(
                f"no GPU memory is left for the KV cache: {gpu_memory_utilization} of {memory.total / GiB:.1f} GiB "
                f"minus {memory.this_process / GiB:.1f} GiB already held (weights) and an estimated "
                f"{activation_bytes / GiB:.1f} GiB of activations leaves {allowed / GiB:.2f} GiB, with "
                f"{memory.free / GiB:.1f} GiB free; raise gpu_memory_utilization, lower max_num_batched_tokens "
                "or free the GPU"
            )
    else:
        budget = cpu_cache_bytes
    blocks = budget // block_bytes - 1  # the null block comes out of the budget
    if blocks < 1:
        raise ValueError(f"a KV cache of {budget} bytes holds less than one block of {block_bytes} bytes; raise it")
    return min(blocks, blocks_needed(max_useful_tokens, block_size))


def device_memory(device: torch.device) -> DeviceMemory:
    """The GPU's total and free memory and the bytes of this process's live tensors (the weights, mostly).

    Cached but unused allocator blocks (loading leaves gigabytes of them) are released first, so that
    they count neither as held by this process nor against the free memory.
    """
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, this_process=torch.cuda.memory_allocated(device))


def context_rows(table: torch.Tensor, lens: torch.Tensor, page: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each context position's cache row from a block table: table [B, W] (block of each `page`-row page), lens
    [B] -> rows [B, width] (positions past a sequence's length: the null block's first row, which reads zeros)
    and valid [B, width], `width` <= W * page. Built on the device; the padded layout of the eager gather (the
    decode kernel's oracle)."""
    B, W = table.shape
    rows = (table[:, :, None] * page + torch.arange(page, device=table.device)).reshape(B, W * page)[:, :width]
    valid = torch.arange(width, device=table.device)[None, :] < lens[:, None]
    return rows.masked_fill(~valid, NULL_BLOCK * page), valid


@dataclass(frozen=True)
class DecodeContext:
    """What a step's batched decodes attend to: sequence b's position l sits at cache row
    `table[b, l // page] * page + l % page` for l < lens[b]."""

    table: torch.Tensor  # [Bd, W] int64
    lens: torch.Tensor  # [Bd] int32, on the device
    page: int
    width: int  # the longest context (host-known): how far the eager gather reaches, <= W * page


def decode_context(batch: Batch, block_size: int) -> DecodeContext:
    """The batched decodes' block tables and lengths that `prepare` made, or a CUDA graph's static ones (page = the
    block size). `width` (the longest context, host-known from `batch.context_lens`) bounds the eager gather only;
    the kernel reads the lengths on the device, so a captured step reads each replay's."""
    if batch.decode_tables is None or batch.decode_lens is None:
        raise ValueError("the batch holds no batched decodes; PagedLatentCache.prepare fills them")
    width = max(batch.context_lens[i] for i in batch.decode_seqs) + 1
    return DecodeContext(batch.decode_tables, batch.decode_lens, block_size, width)


class BlockPool:
    """Which blocks are free. Check-then-act: `can_allocate` says whether `allocate` would succeed.

    Blocks are handed out lowest id first, so the part of the pool in use stays compact (on CPU only the
    pages of blocks once handed out ever become resident).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(NULL_BLOCK + 1, num_blocks + 1))  # sorted: already a heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"{num_blocks} blocks were asked for but {len(self._free)} are free")
        return [heapq.heappop(self._free) for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)


class PagedLatentCache:
    """The MLA latent cache of every layer in one pool of blocks, with one block table per sequence slot.

    `allocate(num_tokens) -> slot` reserves the blocks of a whole sequence; `prepare(batch)` once per
    step; then each layer calls `write` once and `read` for the contexts it attends to.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_seqs: int = 256,
        dtype: torch.dtype,
        device: torch.device | str,
        max_blocks_per_seq: int | None = None,
    ) -> None:
        if block_size < 1 or max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be at least 1")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.pool = BlockPool(num_blocks)
        width = config.kv_lora_rank + config.qk_rope_head_dim
        # One scratch row past the last block: the padding rows of a CUDA-graph batch write there (graphs.decode),
        # so the null block stays zero; nothing ever reads it.
        rows = (num_blocks + 1) * block_size + 1
        self.scratch_row = rows - 1
        self.cache = torch.empty(config.num_hidden_layers, rows, width, dtype=dtype, device=self.device)
        self.cache[:, : block_size * (NULL_BLOCK + 1)].zero_()
        table_width = min(num_blocks, max_blocks_per_seq or num_blocks)
        self.block_tables = torch.zeros(max_num_seqs, table_width, dtype=torch.long, device=self.device)
        self._offsets = torch.arange(block_size, device=self.device)  # [B]
        self._blocks: dict[int, list[int]] = {}  # slot -> its blocks (host mirror of its block-table row)
        self._free_slots = list(range(max_num_seqs))  # a heap
        self._pending: list[int] = []  # slots whose block-table row still has to reach the device

    # --- sizes ---

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.pool.num_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.nbytes / GiB:.2f} GiB"
        )

    # --- admission ---

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_needed(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` cache rows can be admitted now (a free slot and free blocks)."""
        return bool(self._free_slots) and self.pool.can_allocate(self.blocks_for(num_tokens))

    def allocate(self, num_tokens: int) -> int:
        """Reserve the blocks for `num_tokens` rows; returns the sequence's slot (its block-table row)."""
        if not self._free_slots:
            raise RuntimeError(f"all {self.max_num_seqs} sequence slots are in use")
        blocks = self.pool.allocate(self.blocks_for(num_tokens))
        slot = heapq.heappop(self._free_slots)
        self._blocks[slot] = blocks
        self._pending.append(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give a sequence's blocks and slot back. Its block-table row is left as is: nothing reads it."""
        self.pool.free(self._blocks.pop(slot))
        if slot in self._pending:
            self._pending.remove(slot)
        heapq.heappush(self._free_slots, slot)

    @property
    def num_sequences(self) -> int:
        return len(self._blocks)

    # --- one step ---

    def _flat_rows(self, blocks: list[int], start: int, n: int) -> list[int]:
        B = self.block_size
        return [blocks[p // B] * B + p % B for p in range(start, start + n)]

    def rows(self, slot: int, n: int) -> list[int]:
        """The cache rows of a sequence's first `n` positions (its keys up to there)."""
        return self._flat_rows(self._blocks[slot], 0, n)

    def prepare(self, batch: Batch, *host: torch.Tensor) -> list[torch.Tensor]:
        """Fill the batch's device metadata; returns `host` (1-D int64 CPU tensors) on the device.

        Everything crosses in one host->device copy (pinned and asynchronous on CUDA): `host`, the slot
        mapping, the batched decode's token rows, slots and lengths, and the block-table rows of
        sequences admitted since the last step. The context rows are then built on the device.
        """
        B = self.block_size
        slot_mapping: list[int] = []
        for slot, n, ctx in zip(batch.slots, batch.query_lens, batch.context_lens, strict=True):
            blocks = self._blocks.get(slot)
            if blocks is None:
                raise ValueError(f"sequence slot {slot} holds no cache blocks")
            if ctx + n > len(blocks) * B:
                raise ValueError(
                    f"sequence slot {slot} reserved {len(blocks) * B} tokens; cannot write up to {ctx + n}"
                )
            slot_mapping += self._flat_rows(blocks, ctx, n)
        decode = batch.decode_seqs
        starts = batch.starts
        decode_meta = [
            [starts[i] for i in decode],
            [batch.slots[i] for i in decode],
            [batch.context_lens[i] + 1 for i in decode],
        ]
        pending = [s for s in self._pending if s in self._blocks]
        self._pending = []
        width = max((len(self._blocks[s]) for s in pending), default=0)
        if width > self.block_tables.shape[1]:  # rare: a sequence longer than any before; widen the tables
            wider = torch.zeros(self.max_num_seqs, width, dtype=torch.long, device=self.device)
            wider[:, : self.block_tables.shape[1]] = self.block_tables
            self.block_tables = wider
        table_w = self.block_tables.shape[1]
        table_idx = [s * table_w + j for s in pending for j in range(len(self._blocks[s]))]
        table_val = [b for s in pending for b in self._blocks[s]]

        parts = [*host, torch.tensor(slot_mapping + sum(decode_meta, []) + table_idx + table_val, dtype=torch.long)]
        sizes = [p.numel() for p in parts]
        cuda = self.device.type == "cuda"
        packed = torch.empty(sum(sizes), dtype=torch.long, pin_memory=cuda)
        torch.cat(parts, out=packed)
        on_device = packed.to(self.device, non_blocking=True).split(sizes)
        *extras, meta = on_device
        nd, nt = len(decode), len(table_idx)
        slot_map, dec_rows, dec_slots, dec_lens, t_idx, t_val = meta.split([len(slot_mapping), nd, nd, nd, nt, nt])
        if nt:
            self.block_tables.view(-1).index_copy_(0, t_idx, t_val)

        batch.slot_mapping = slot_map
        batch.decode_token_rows = dec_rows if nd else None
        batch.decode_tables = batch.decode_lens = None
        if nd:  # a CUDA-graph step copies both into its static buffers (graphs.decode)
            nblk = blocks_needed(max(decode_meta[2]), B)
            batch.decode_tables = self.block_tables[dec_slots, :nblk]  # [Bd, nblk]
            batch.decode_lens = dec_lens.to(torch.int32)  # [Bd]
        batch.context_rows = {}
        in_decode = set(decode)
        for i, (slot, n, ctx) in enumerate(zip(batch.slots, batch.query_lens, batch.context_lens, strict=True)):
            if ctx == 0 or i in in_decode:
                continue  # a fresh prompt attends to its own new latents; nothing to gather
            length = ctx + n
            nblk = blocks_needed(length, B)
            table = self.block_tables[slot, :nblk]  # [nblk], a view: no host round trip
            batch.context_rows[i] = (table[:, None] * B + self._offsets).reshape(-1)[:length]
        return extras

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, latent: torch.Tensor) -> None:
        """Write every token's latent [T, C + R] of this step at its row: one `index_copy_`."""
        self.cache[layer_idx].index_copy_(0, slot_mapping, latent)

    def read(self, layer_idx: int, rows: torch.Tensor) -> torch.Tensor:
        """Gather cached latents: rows [...] -> [..., C + R]."""
        return self.cache[layer_idx][rows]

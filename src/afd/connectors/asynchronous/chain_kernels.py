"""Device-driven async exchange kernels: an FFN item's bookkeeping (`asynchronous.ffn_chain`) in two launches,
and an attention rank's send and receive inside a captured decode step (`afd.connectors.asynchronous.attention`).

Eagerly, checking a request's header on the device, masking its rows, adding the shared experts, writing the
reply and updating the flags and counters is ~25 small PyTorch kernels (~2 µs each inside a graph), more than
the experts cost at decode sizes. Here it is two launches around the experts, none reading anything back to
the host (capturable):

1. `check_request`: one program reads the header, the flag and the abort word and decides `ok` (request, this
   layer, at most `n` rows, header seq = flag, nothing aborted before); it writes the top-k ids of the `n` rows
   as int64 with the rows past the header's count set to -1 (they route nowhere) and the shared-experts mask.
2. `reply_item`: one program per row writes `routed + mask * shared` into the attention rank's reply rows (its
   dtype; only the message's rows, not the bucket's padding); the last program to arrive writes the reply header
   (the request's, with the response flag and the seq echoed), resets the local flag to 0 if `ok`, updates
   [abort, served, max rows], and, if `ok`, stores the reply's flag (the request's seq) into the attention rank's
   window with a system-scope release, so the rows and the header are visible first.

The attention side's send is one launch too (`send_request`: rows, ids, weights, header, flag), measured at
~10 µs per layer as three copies and a stamp kernel.

`afd.connectors.asynchronous.ffn_chain` keeps the same steps in PyTorch as the CPU path and the oracle of
`tests/unit/test_chain_kernels_steps.py` and `tests/e2e/test_chain_kernels.py` (on CPU through Triton's interpreter, on
a GPU compiled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afd.connectors.asynchronous.wire import (
    FLAG_RESPONSE,
    HEADER_WORDS,
    MAGIC_WORD,
    VERSION,
    W_ECHO_SEQ,
    W_FLAGS,
    W_LAYER,
    W_MAGIC,
    W_NUM_TOKENS,
    W_ROWS,
    W_SEQ,
    W_SHARED,
    W_VERSION,
)


# integer arguments are not specialized (==1, %16): one compile each, done before any capture
@triton.jit(do_not_specialize=["layer", "n"])
def _check_kernel(
    hdr_ptr, flag_ptr, stats_ptr, ids_ptr, ids_out_ptr, mask_out_ptr, ok_ptr,
    layer, n, magic, version,
    K: tl.constexpr, BLOCK_IDS: tl.constexpr, BLOCK_N: tl.constexpr,
    W_MAGIC_: tl.constexpr, W_VERSION_: tl.constexpr, W_FLAGS_: tl.constexpr, W_LAYER_: tl.constexpr,
    W_ROWS_: tl.constexpr, W_SHARED_: tl.constexpr, W_SEQ_: tl.constexpr,
):  # fmt: skip
    rows = tl.load(hdr_ptr + W_ROWS_)
    shared = tl.load(hdr_ptr + W_SHARED_)
    seq = tl.load(flag_ptr)
    seq_word = tl.load(hdr_ptr + W_SEQ_).to(tl.int64) & 0xFFFFFFFF
    ok = (tl.load(stats_ptr) == 0) & (seq >= 1)
    ok = ok & (tl.load(hdr_ptr + W_MAGIC_) == magic) & (tl.load(hdr_ptr + W_VERSION_) == version)
    ok = ok & (tl.load(hdr_ptr + W_FLAGS_) == 0) & (tl.load(hdr_ptr + W_LAYER_) == layer)
    ok = ok & (rows <= n) & (shared <= rows) & (seq_word == (seq & 0xFFFFFFFF))
    tl.store(ok_ptr, ok.to(tl.int32))
    offs = tl.arange(0, BLOCK_IDS)
    in_range = offs < n * K
    ids = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int64)
    tl.store(ids_out_ptr + offs, tl.where(offs // K < rows, ids, -1), mask=in_range)
    row = tl.arange(0, BLOCK_N)
    tl.store(mask_out_ptr + row, (row < shared).to(tl.float32), mask=row < n)


@triton.jit(do_not_specialize=["H", "n"])
def _reply_kernel(
    routed_ptr, shared_ptr, mask_ptr, out_ptr, hdr_ptr, reply_hdr_ptr, flag_ptr, stats_ptr, ok_ptr, reply_flag_ptr,
    arrive_ptr, H, n,
    BLOCK_H: tl.constexpr, HW: tl.constexpr, BLOCK_W: tl.constexpr, W_FLAGS_: tl.constexpr, W_ECHO_: tl.constexpr,
    W_SEQ_: tl.constexpr, W_ROWS_: tl.constexpr, RESPONSE: tl.constexpr, HAS_SHARED: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    in_row = (cols < H) & (r < tl.load(hdr_ptr + W_ROWS_))  # a bucket's padding rows are never written back
    total = tl.load(routed_ptr + r * H + cols, mask=in_row, other=0.0)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + r * H + cols, mask=in_row, other=0.0).to(tl.float32)
        total = total + tl.load(mask_ptr + r) * shared
    tl.store(out_ptr + r * H + cols, total.to(out_ptr.dtype.element_ty), mask=in_row)
    tl.debug_barrier()
    # the last row's program to arrive writes the reply's header, updates the item's words, then the flag
    arrived = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="sys")
    if arrived == n - 1:
        tl.store(arrive_ptr, 0)
        idx = tl.arange(0, BLOCK_W)
        words = tl.load(hdr_ptr + idx, mask=idx < HW, other=0)
        seq_word = tl.load(hdr_ptr + W_SEQ_)
        answer = tl.where(idx == W_FLAGS_, RESPONSE, tl.where(idx == W_ECHO_, seq_word, words))
        tl.store(reply_hdr_ptr + idx, answer, mask=idx < HW)
        ok = tl.load(ok_ptr) != 0
        seq = tl.load(flag_ptr)
        rows = tl.load(hdr_ptr + W_ROWS_).to(tl.int64)
        tl.store(flag_ptr, tl.where(ok, 0, seq))
        abort = tl.load(stats_ptr)
        tl.store(stats_ptr, tl.where(ok, abort, 1))
        tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + ok.to(tl.int64))
        tl.store(stats_ptr + 2, tl.maximum(tl.load(stats_ptr + 2), rows))
        tl.debug_barrier()
        tl.atomic_xchg(reply_flag_ptr, seq, mask=ok, sem="release", scope="sys")


def check_request(
    header: torch.Tensor,  # [HEADER_WORDS] int32
    flag: torch.Tensor,  # [1] int64
    stats: torch.Tensor,  # [3] int64
    topk_ids: torch.Tensor,  # [>= n, K] int32, contiguous rows
    layer_idx: int,
    n: int,
    ids_out: torch.Tensor,  # [n, K] int64
    mask_out: torch.Tensor,  # [n] fp32
    ok_out: torch.Tensor,  # [1] int32
) -> None:
    k = topk_ids.shape[1]
    _check_kernel[(1,)](
        header, flag, stats, topk_ids, ids_out, mask_out, ok_out,
        layer_idx, n, MAGIC_WORD, VERSION,
        K=k, BLOCK_IDS=triton.next_power_of_2(n * k), BLOCK_N=triton.next_power_of_2(n),
        W_MAGIC_=W_MAGIC, W_VERSION_=W_VERSION, W_FLAGS_=W_FLAGS, W_LAYER_=W_LAYER, W_ROWS_=W_ROWS,
        W_SHARED_=W_SHARED, W_SEQ_=W_SEQ,
    )  # fmt: skip


def reply_item(
    routed: torch.Tensor,  # [n, H] fp32
    shared: torch.Tensor | None,  # [n, H]; None: the attention rank runs the shared experts
    mask: torch.Tensor,  # [n] fp32
    out: torch.Tensor,  # [>= n, H] the reply rows (any dtype), contiguous
    header: torch.Tensor,  # [HEADER_WORDS] int32: the request's
    reply_header: torch.Tensor,  # [HEADER_WORDS] int32
    flag: torch.Tensor,  # [1] int64: the request's flag
    stats: torch.Tensor,  # [3] int64
    ok: torch.Tensor,  # [1] int32: check_request's verdict
    reply_flag: torch.Tensor,  # [1] int64: the reply's flag, in the attention rank's window
    arrive: torch.Tensor,  # [1] int32 scratch, 0 between launches
) -> None:
    """The reply (rows, header) and the item's bookkeeping (flags, counters) in one launch; before, two (a kernel
    boundary and ~2 µs more per item)."""
    n, hidden = routed.shape
    _reply_kernel[(n,)](
        routed, routed if shared is None else shared, mask, out, header, reply_header, flag, stats, ok, reply_flag,
        arrive, hidden, n,
        BLOCK_H=triton.next_power_of_2(hidden), HW=HEADER_WORDS, BLOCK_W=triton.next_power_of_2(HEADER_WORDS),
        W_FLAGS_=W_FLAGS, W_ECHO_=W_ECHO_SEQ, W_SEQ_=W_SEQ, W_ROWS_=W_ROWS, RESPONSE=FLAG_RESPONSE,
        HAS_SHARED=shared is not None,
    )  # fmt: skip


# ---------------------------------------------------------------- the attention side, inside a decode graph
@triton.jit(do_not_specialize=["layer", "T", "H", "x_stride"])
def _send_kernel(
    x_ptr, ids_ptr, w_ptr, dst_x_ptr, dst_ids_ptr, dst_w_ptr, counter_ptr, arrive_ptr, hdr_ptr, flag_ptr,
    layer, T, H, x_stride, magic, version,
    K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, HW: tl.constexpr, BLOCK_W: tl.constexpr,
    W_MAGIC_: tl.constexpr, W_VERSION_: tl.constexpr, W_LAYER_: tl.constexpr, W_TOKENS_: tl.constexpr,
    W_ROWS_: tl.constexpr, W_SHARED_: tl.constexpr, W_SEQ_: tl.constexpr, SHARED_ON_FFN: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    row = tl.load(x_ptr + r * x_stride + cols, mask=cols < H, other=0.0)
    tl.store(dst_x_ptr + r * H + cols, row.to(dst_x_ptr.dtype.element_ty), mask=cols < H)
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + r * K + kk, mask=kk < K, other=0)
    tl.store(dst_ids_ptr + r * K + kk, ids.to(dst_ids_ptr.dtype.element_ty), mask=kk < K)
    weights = tl.load(w_ptr + r * K + kk, mask=kk < K, other=0.0)
    tl.store(dst_w_ptr + r * K + kk, weights.to(dst_w_ptr.dtype.element_ty), mask=kk < K)
    tl.debug_barrier()
    # the last row's program to arrive publishes: every row (released at system scope on the way in) lands first
    arrived = tl.atomic_add(arrive_ptr, 1, sem="acq_rel", scope="sys")
    if arrived == T - 1:
        tl.store(arrive_ptr, 0)  # no program of this launch touches it again
        seq = tl.load(counter_ptr) + 1
        tl.store(counter_ptr, seq)
        idx = tl.arange(0, BLOCK_W)
        seq_word = (seq & 0xFFFFFFFF).to(tl.int32)
        words = tl.where(idx == W_MAGIC_, magic, 0)
        words = tl.where(idx == W_VERSION_, version, words)
        words = tl.where(idx == W_LAYER_, layer, words)
        words = tl.where((idx == W_TOKENS_) | (idx == W_ROWS_), T, words)
        if SHARED_ON_FFN:
            words = tl.where(idx == W_SHARED_, T, words)  # else 0: the attention rank runs the shared experts
        words = tl.where(idx == W_SEQ_, seq_word, words)
        tl.store(hdr_ptr + idx, words, mask=idx < HW)
        tl.debug_barrier()
        # release at system scope: the header lands before the flag
        tl.atomic_xchg(flag_ptr, seq, sem="release", scope="sys")


def send_request(
    x: torch.Tensor,  # [T, H] model dtype, rows contiguous
    topk_ids: torch.Tensor,  # [T, K] any integer dtype, contiguous
    topk_weights: torch.Tensor,  # [T, K] float, contiguous
    dst_x: torch.Tensor,  # [>= T, H] the peer slot's rows
    dst_ids: torch.Tensor,  # [>= T, K] int32
    dst_weights: torch.Tensor,  # [>= T, K] fp32
    counter: torch.Tensor,  # [1] int64: the last seq taken
    arrive: torch.Tensor,  # [1] int32 scratch, 0 between launches
    header: torch.Tensor,  # [HEADER_WORDS] int32, the peer slot's
    flag: torch.Tensor,  # [1] int64, the peer slot's
    layer_idx: int,
    *,
    shared_on_ffn: bool = True,
) -> None:
    """One launch for a whole request: copy the `T` rows, ids and weights into the peer's slot, take the next seq
    from `counter` and publish the header, then the flag. Every row is a shared row unless `shared_on_ffn` is
    False (the attention rank runs the shared experts)."""
    num_tokens, hidden = x.shape
    k = topk_ids.shape[1]
    if num_tokens < 1 or x.stride(1) != 1 or not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("send_request needs at least one row, rows with unit stride and contiguous ids and weights")
    _send_kernel[(num_tokens,)](
        x, topk_ids, topk_weights, dst_x, dst_ids, dst_weights, counter, arrive, header, flag,
        layer_idx, num_tokens, hidden, x.stride(0), MAGIC_WORD, VERSION,
        K=k, BLOCK_H=triton.next_power_of_2(hidden), BLOCK_K=triton.next_power_of_2(k),
        HW=HEADER_WORDS, BLOCK_W=triton.next_power_of_2(HEADER_WORDS), W_MAGIC_=W_MAGIC, W_VERSION_=W_VERSION,
        W_LAYER_=W_LAYER, W_TOKENS_=W_NUM_TOKENS, W_ROWS_=W_ROWS, W_SHARED_=W_SHARED, W_SEQ_=W_SEQ,
        SHARED_ON_FFN=shared_on_ffn,
    )  # fmt: skip


@triton.jit(do_not_specialize=["layer", "T", "H"])
def _take_kernel(
    hdr_ptr, flag_ptr, rows_ptr, out_ptr, counter_ptr, errors_ptr, layer, T, H, magic, version,
    BLOCK_H: tl.constexpr, W_MAGIC_: tl.constexpr, W_VERSION_: tl.constexpr, W_FLAGS_: tl.constexpr,
    W_LAYER_: tl.constexpr, W_ROWS_: tl.constexpr, W_ECHO_: tl.constexpr, RESPONSE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    row = tl.load(rows_ptr + r * H + cols, mask=cols < H, other=0.0)
    tl.store(out_ptr + r * H + cols, row.to(out_ptr.dtype.element_ty), mask=cols < H)
    if r == 0:
        seq_word = (tl.load(counter_ptr) & 0xFFFFFFFF).to(tl.int32)
        ok = (tl.load(hdr_ptr + W_MAGIC_) == magic) & (tl.load(hdr_ptr + W_VERSION_) == version)
        ok = ok & ((tl.load(hdr_ptr + W_FLAGS_) & RESPONSE) != 0) & (tl.load(hdr_ptr + W_ECHO_) == seq_word)
        ok = ok & (tl.load(hdr_ptr + W_LAYER_) == layer) & (tl.load(hdr_ptr + W_ROWS_) == T)
        tl.store(errors_ptr, tl.load(errors_ptr) + (1 - ok.to(tl.int64)))
        tl.store(flag_ptr, 0)  # consumed: the next reply sets it again (it comes after the next request)


def take_reply(
    header: torch.Tensor,  # [HEADER_WORDS] int32: the reply's, in this rank's window
    flag: torch.Tensor,  # [1] int64: the reply's flag (reset to 0)
    rows: torch.Tensor,  # [>= T, H] the reply rows
    out: torch.Tensor,  # [T, H] model dtype
    counter: torch.Tensor,  # [1] int64: the seq of the request this answers
    errors: torch.Tensor,  # [1] int64: replies that failed the check, so far
    layer_idx: int,
) -> None:
    """Copy a reply out after its flag was waited for, check its header on the device (magic, version, response,
    echo of the request's seq, layer, rows: a failure counts into `errors`, read by the host later) and reset the
    flag."""
    num_tokens, hidden = out.shape
    _take_kernel[(num_tokens,)](
        header, flag, rows, out, counter, errors, layer_idx, num_tokens, hidden, MAGIC_WORD, VERSION,
        BLOCK_H=triton.next_power_of_2(hidden), W_MAGIC_=W_MAGIC, W_VERSION_=W_VERSION, W_FLAGS_=W_FLAGS,
        W_LAYER_=W_LAYER, W_ROWS_=W_ROWS, W_ECHO_=W_ECHO_SEQ, RESPONSE=FLAG_RESPONSE,
    )  # fmt: skip

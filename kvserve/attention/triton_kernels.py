"""The Triton kernels of ``TritonPagedBackend``: the K/V store, paged decode (flash-decoding, and cascade
attention's shared prefix), its split merge, and paged prefill.

The store writes a step's new keys and values of an unquantized cache into their slots, both in one launch
(``KVCacheStorage.write``, which also quantizes, takes two copies), and may rotate the keys and the queries on
the way (the rotary embedding, one launch fewer a layer). The other three read K/V in place from the
paged cache (``[num_blocks, block_size, num_kv_heads, head_dim]``), a key at position p of a sequence lying at
slot ``table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE``. Scores
are kept in the log2 domain (the softmax scale is pre-multiplied by log2 e, so ``exp2`` is one instruction),
and every softmax state (running max, sum, accumulator) is fp32 whatever the inputs.

A quantized cache (``QUANT``: int8 or fp8 codes with one fp16 scale per token per KV head, or int4 codes two a
byte with an fp16 scale and zero point per group of ``QUANT_GROUP`` values; ``kv/quant.py``) is dequantized tile
by tile as it is loaded, to the queries' dtype, as the reference's gather does; int4 keys stay rotated as stored,
and the backend hands these kernels queries rotated alike.

Importing this module imports triton; only the backend (and the tests) do, never the CPU engine.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.triton_launch import enter_chain

# A running max that starts finite: a row that sees no key in a tile then gets exp2(-inf - NEG_INIT) = 0 rather
# than exp2(-inf + inf) = nan (padding rows, and rows whose window starts after the tile).
NEG_INIT = tl.constexpr(-1.0e30)
# ``QUANT``: how the cache stores K/V (kv/quant.py): the values themselves, codes times one scale per token per
# KV head (int8, fp8), or int4 codes packed two a byte with a scale and a zero point per group of a row
UNQUANTIZED, SCALED, INT4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def store_kv_kernel(k_cache, v_cache, k, v, slots, stride_kt, stride_kh, stride_vt, stride_vh, stride_block,
                    stride_slot, stride_head, num_kv_heads, q, stride_qt, stride_qh, num_heads, cos, sin, stride_cos,
                    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                    ROPE: tl.constexpr, BLOCK_QH: tl.constexpr, PDL: tl.constexpr):
    """One program per new token: its [num_kv_heads, HEAD_DIM] key and value rows into slot ``slots[t]``. With
    ``ROPE`` the key is stored rotated by the token's cos / sin [HEAD_DIM / 2], and its [num_heads, HEAD_DIM]
    query rotated in place, each as the fused ops' rotary kernel rotates them (the same fp32 arithmetic, one
    rounding): the layer's rotary launch folded into this one."""
    enter_chain(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    dst = (slot // PAGE_SIZE) * stride_block + (slot % PAGE_SIZE) * stride_slot \
        + offs_h[:, None] * stride_head + offs_d[None, :]
    value = tl.load(v + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache + dst, value, mask=mask)
    if ROPE:
        half = HEAD_DIM // 2
        offs_half = tl.arange(0, BLOCK_D // 2)
        mask_half = offs_half < half
        c = tl.load(cos + t * stride_cos + offs_half, mask=mask_half, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin + t * stride_cos + offs_half, mask=mask_half, other=0.0).to(tl.float32)[None, :]
        offs_qh = tl.arange(0, BLOCK_QH)
        query = q + t * stride_qt + offs_qh[:, None] * stride_qh + offs_half[None, :]
        _rotate_halves(query, query, (offs_qh[:, None] < num_heads) & mask_half[None, :], c, s, half)
        key = k + t * stride_kt + offs_h[:, None] * stride_kh + offs_half[None, :]
        key_dst = k_cache + (slot // PAGE_SIZE) * stride_block + (slot % PAGE_SIZE) * stride_slot \
            + offs_h[:, None] * stride_head + offs_half[None, :]
        _rotate_halves(key, key_dst, (offs_h[:, None] < num_kv_heads) & mask_half[None, :], c, s, half)
    else:
        key = tl.load(k + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        tl.store(k_cache + dst, key, mask=mask)


@triton.jit
def _rotate_halves(src, dst, mask, c, s, half):
    """Rows of ``2 * half`` values at ``src`` (pointers to their first halves) rotated into ``dst``, HF's
    half-split convention: ``(x1 * c - x2 * s, x2 * c + x1 * s)`` in fp32, rounded to ``dst``'s dtype."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _slots(table_row, pos, mask, PAGE_SIZE: tl.constexpr):
    """Flat cache slots (int64) of key positions ``pos`` through one sequence's row of the block tables."""
    block = tl.load(table_row + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    return block * PAGE_SIZE + pos % PAGE_SIZE


@triton.jit
def _load_rows(cache, scales, slots, kv_head, offs_d, mask_n, mask_d, stride_slot, stride_head,
               scale_stride_slot, OUT_DTYPE: tl.constexpr, QUANT: tl.constexpr, QUANT_GROUP: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] tile of one KV head's keys (or values), dequantized to ``OUT_DTYPE`` (int4 keys as
    stored, rotated: the backend rotates the queries alike)."""
    mask = mask_n[:, None] & mask_d[None, :]
    if QUANT == INT4:  # value d: byte d % (QUANT_GROUP / 2) of its group, the high nibble in the group's second
        half = QUANT_GROUP // 2  # half; each group's params (s, z) in order, 2 * HEAD_DIM / QUANT_GROUP a row
        group, in_group = offs_d // QUANT_GROUP, offs_d % QUANT_GROUP
        ptrs = cache + slots[:, None] * stride_slot + kv_head * stride_head + (group * half + in_group % half)[None, :]
        packed = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        codes = (packed >> (4 * (in_group >= half).to(tl.int32))[None, :]) & 15
        params = (scales + slots[:, None] * scale_stride_slot + kv_head * (2 * HEAD_DIM // QUANT_GROUP)
                  + (2 * group)[None, :])
        s = tl.load(params, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(params + 1, mask=mask, other=0.0).to(tl.float32)
        return tl.where(mask, codes.to(tl.float32) * s + z, 0.0).to(OUT_DTYPE)
    ptrs = cache + slots[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :]
    if QUANT == SCALED:  # scales are [num_slots, num_kv_heads, 1]: one per token per KV head
        s = tl.load(scales + slots * scale_stride_slot + kv_head, mask=mask_n, other=0.0).to(tl.float32)
        # no ``other`` for the codes: the interpreter cannot make an fp8 zero; masked lanes are zeroed after
        return tl.where(mask, tl.load(ptrs, mask=mask).to(tl.float32) * s[:, None], 0.0).to(OUT_DTYPE)
    return tl.load(ptrs, mask=mask, other=0.0).to(OUT_DTYPE)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr):
    """a @ b with fp32 accumulation. ``UPCAST_DOTS``: the operands (already rounded to their dtype) go in as
    fp32, because Triton 3.9's interpreter multiplies bf16 operands as garbage."""
    if UPCAST_DOTS:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _online_softmax_step(acc, m, l, scores, v, PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr):
    """Fold one tile of log2-domain scores [rows, keys] (-inf where hidden) and its values into the state."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST_DOTS)
    return acc, m_new, l


@triton.jit
def _attend_key_range(queries, table_row, start, end, k_cache, v_cache, k_scales, v_scales, kv_head, offs_d, mask_d,
                      stride_slot, stride_head, scale_stride_slot, scale_log2, PAGE_SIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr, QUANT: tl.constexpr, QUANT_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr):
    """The online-softmax state (acc, running max, sum) of the rows of ``queries`` over one sequence's keys
    ``start`` .. ``end`` (its row of the block tables at ``table_row``), every key visible to every row."""
    m = tl.full([queries.shape[0]], NEG_INIT, tl.float32)
    l = tl.zeros([queries.shape[0]], tl.float32)
    acc = tl.zeros([queries.shape[0], offs_d.shape[0]], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n in range(start, end, BLOCK_N):
        pos = n + offs_n
        mask_n = pos < end
        slots = _slots(table_row, pos, mask_n, PAGE_SIZE)
        keys = _load_rows(k_cache, k_scales, slots, kv_head, offs_d, mask_n, mask_d, stride_slot, stride_head,
                          scale_stride_slot, queries.dtype, QUANT, QUANT_GROUP, HEAD_DIM)
        scores = _dot(queries, tl.trans(keys), PRECISION, UPCAST_DOTS) * scale_log2
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        values = _load_rows(v_cache, v_scales, slots, kv_head, offs_d, mask_n, mask_d, stride_slot, stride_head,
                            scale_stride_slot, queries.dtype, QUANT, QUANT_GROUP, HEAD_DIM)
        acc, m, l = _online_softmax_step(acc, m, l, scores, values, PRECISION, UPCAST_DOTS)
    return acc, m, l


@triton.jit
def cascade_prefix_kernel(
    out, stride_ot, stride_oh, stride_os, lse, q, stride_qt, stride_qh,
    k_cache, v_cache, k_scales, v_scales, stride_slot, stride_head, scale_stride_slot,
    block_tables, stride_table, shared_lens, order, scale_log2, num_decodes, num_slots,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, DECODES_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
    QUANT_GROUP: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Cascade attention's first level. One program per (KV head, split, tile of DECODES_PER_TILE decodes
    taken in ``order``, which puts the decodes whose tables start with the same block together). Each run of a
    group's decodes in the tile attends the keys its members share (``shared_lens``, from any member's table)
    at once, all their query heads of the KV head as the rows of one dot (row r: decode r // GROUP, head r %
    GROUP), so that a shared key is read once a tile rather than once a decode::

        tile rows (decodes in order):  | a a a a | b b | c | d d d ... |     run by run; c shares nothing
        keys of a run, split S ways:   | split 0 | split 1 | ... |          (0 .. its shared length)

    Each row's normalised output and log2-sum-exp2 go to its decode's partial slot ``split`` (``out`` [D,
    num_heads, num_slots, head_dim], ``lse`` [D, num_heads, num_slots]); ``paged_decode_kernel`` attends the
    rest of each decode's keys into the slots after these, and the merge folds them all. A sharing decode whose
    share this split does not reach gets an empty state (zeros, lse ~ NEG_INIT): weight 0; a decode that shares
    nothing gets nothing, its merge starting after the prefix slots (a graph's step that shares nothing costs
    these programs a few loads each).
    """
    enter_chain(PDL)
    kv_head, split, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(1)
    offs_m, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    position = tile * DECODES_PER_TILE + offs_m // GROUP
    mask_m = (offs_m < DECODES_PER_TILE * GROUP) & (position < num_decodes)
    decode = tl.load(order + position, mask=mask_m, other=0)
    shared = tl.load(shared_lens + decode, mask=mask_m, other=0)
    first_block = tl.load(block_tables + decode * stride_table, mask=mask_m, other=-1)
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_m % GROUP
    rows = decode[:, None] * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    row_lse = lse + (decode * tl.num_programs(0) * GROUP + heads) * num_slots + split
    todo = mask_m & (shared > 0)  # a decode alone: its prefix slots are neither written nor merged
    queries = tl.load(q + decode[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                      mask=todo[:, None] & mask_d[None, :], other=0)  # a step that shares nothing reads none
    while tl.max(todo.to(tl.int32), 0) > 0:
        lead = tl.min(tl.where(todo, offs_m, BLOCK_M), 0)  # the first row left: its group is the next run
        run = todo & (first_block == tl.max(tl.where(offs_m == lead, first_block, -1), 0))
        run_len = tl.max(tl.where(run, shared, 0), 0)  # every member's
        table_row = block_tables + tl.max(tl.where(offs_m == lead, decode, 0), 0).to(tl.int64) * stride_table
        split_len = (run_len + num_splits - 1) // num_splits
        start = split * split_len
        end = tl.minimum(start + split_len, run_len)
        acc, m, l = _attend_key_range(queries, table_row, start, end, k_cache, v_cache, k_scales, v_scales, kv_head,
                                      offs_d, mask_d, stride_slot, stride_head, scale_stride_slot, scale_log2,
                                      PAGE_SIZE, BLOCK_N, QUANT, QUANT_GROUP, HEAD_DIM, PRECISION, UPCAST_DOTS)
        l = tl.where(l > 0, l, 1.0)
        tl.store(out + rows, acc / l[:, None], mask=run[:, None] & mask_d[None, :])
        tl.store(row_lse, m + tl.log2(l), mask=run)
        todo = todo & ~run


@triton.jit
def paged_decode_kernel(
    out, stride_ot, stride_oh, stride_os, lse, q, stride_qt, stride_qh,
    k_cache, v_cache, k_scales, v_scales, stride_slot, stride_head, scale_stride_slot,
    block_tables, stride_table, seq_lens, scale_log2, window, merged, stride_mt, stride_mh, counters, shared_lens,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, QUANT_GROUP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr, STORE_LSE: tl.constexpr, MERGE: tl.constexpr,
    PREFIX_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (decode, KV head, split): the GROUP query heads of the KV head (rows of a BLOCK_G tile,
    padded to the 16 rows a dot needs) over the split's share of the visible keys::

        keys:  | hidden by the window | split 0 | split 1 | ... | split S-1 |     (lo = seq_len - window)
               0                      lo                                  seq_len

    With one split (``STORE_LSE`` off) ``out`` is the step's output; else it is the fp32 partial output
    [D, num_heads, slots, head_dim], normalised per split, and ``lse`` gets each split's log2-sum-exp2; an empty
    split stores zeros and lse ~ NEG_INIT. Those are merged into ``merged`` (the step's output) by
    ``merge_splits_kernel``, or with ``MERGE`` here: each split counts itself off on the (decode, KV head)'s
    int32 counter, and the last to finish merges the group's splits (``_merge_group``) and zeroes the counter
    for the next launch: the merge's own launch and its gap saved, at one stream one of a layer's ~12. With
    ``PREFIX_SLOTS`` (cascade attention) the decode's first ``shared_lens[seq]`` keys are
    ``cascade_prefix_kernel``'s, already in the first PREFIX_SLOTS slots: lo starts past them, the splits fill
    the slots after, and the merge takes them all.
    """
    enter_chain(PDL)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    lo = tl.maximum(seq_len - window, 0)
    if PREFIX_SLOTS > 0:
        lo = tl.maximum(lo, tl.load(shared_lens + seq))
    num_splits = tl.num_programs(2)
    split_len = (seq_len - lo + num_splits - 1) // num_splits
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    mask_g, mask_d = offs_g < GROUP, offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    queries = tl.load(q + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                      mask=mask_g[:, None] & mask_d[None, :], other=0)
    acc, m, l = _attend_key_range(queries, block_tables + seq * stride_table, start, end, k_cache, v_cache,
                                  k_scales, v_scales, kv_head, offs_d, mask_d, stride_slot, stride_head,
                                  scale_stride_slot, scale_log2, PAGE_SIZE, BLOCK_N, QUANT, QUANT_GROUP, HEAD_DIM,
                                  PRECISION, UPCAST_DOTS)

    l = tl.where(l > 0, l, 1.0)  # an empty split: acc is 0, and lse ~ NEG_INIT weighs it 0 in the merge
    slot = PREFIX_SLOTS + split
    out_ptrs = out + seq * stride_ot + heads[:, None] * stride_oh + slot * stride_os + offs_d[None, :]
    tl.store(out_ptrs, (acc / l[:, None]).to(out.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    if STORE_LSE:
        num_heads, num_slots = tl.num_programs(1) * GROUP, PREFIX_SLOTS + num_splits
        tl.store(lse + (seq * num_heads + heads) * num_slots + slot, m + tl.log2(l), mask=mask_g)
        if MERGE:
            # every thread's stores done before the count says so; the count's release / acquire at GPU scope
            # then orders them before the last program's loads (the pattern of a cooperative grid sync)
            tl.debug_barrier()
            counter = counters + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                _merge_group(merged + seq * stride_mt, stride_mh, out + seq * stride_ot, stride_oh, stride_os,
                             lse + seq * num_heads * num_slots, heads, mask_g, offs_d, mask_d,
                             _first_slot(shared_lens, seq, PREFIX_SLOTS), num_slots, BLOCK_G)
                tl.store(counter, 0)


@triton.jit
def _first_slot(shared_lens, seq, PREFIX_SLOTS: tl.constexpr):
    """The first partial slot a decode's merge reads: past the prefix slots where it shares nothing (never
    written then)."""
    if PREFIX_SLOTS > 0:
        return tl.where(tl.load(shared_lens + seq) > 0, 0, PREFIX_SLOTS)
    return 0


@triton.jit
def _merge_group(merged, stride_mh, partial, stride_ph, stride_ps, lse, heads, mask_g, offs_d, mask_d, first_slot,
                 num_slots, BLOCK_G: tl.constexpr):
    """One decode's ``heads`` merged from their partial slots ``first_slot`` .. ``num_slots`` (splits), each
    weighted by its share of the softmax sum, exp2(lse_s - max) / sum over splits. The other programs' partials
    are read past the L1 cache (``.cg``), which may hold lines of these addresses from an earlier launch."""
    mask = mask_g[:, None] & mask_d[None, :]
    lse_max = tl.full([BLOCK_G], NEG_INIT, tl.float32)
    for s in range(first_slot, num_slots):
        lse_max = tl.maximum(lse_max, tl.load(lse + heads * num_slots + s, mask=mask_g, other=NEG_INIT,
                                              cache_modifier=".cg"))
    acc = tl.zeros([BLOCK_G, offs_d.shape[0]], tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    for s in range(first_slot, num_slots):
        weight = tl.exp2(tl.load(lse + heads * num_slots + s, mask=mask_g, other=NEG_INIT, cache_modifier=".cg")
                         - lse_max)
        split_out = tl.load(partial + heads[:, None] * stride_ph + s * stride_ps + offs_d[None, :], mask=mask,
                            other=0.0, cache_modifier=".cg")
        acc += weight[:, None] * split_out
        total += weight
    merged_rows = (acc / total[:, None]).to(merged.dtype.element_ty)
    tl.store(merged + heads[:, None] * stride_mh + offs_d[None, :], merged_rows, mask=mask)


@triton.jit
def merge_splits_kernel(
    out, stride_ot, stride_oh, partial, lse, num_splits, shared_lens,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PREFIX_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (decode, query head): the splits' outputs weighted by their share of the softmax sum,
    exp2(lse_s - max) / sum over splits (with ``PREFIX_SLOTS``, from past them for a decode that shares nothing:
    ``_first_slot``)."""
    enter_chain(PDL)
    seq, head = tl.program_id(0), tl.program_id(1)
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    mask_s = (offs_s >= _first_slot(shared_lens, seq, PREFIX_SLOTS)) & (offs_s < num_splits)
    mask_d = offs_d < HEAD_DIM
    row = seq * tl.num_programs(1) + head
    split_lse = tl.load(lse + row * num_splits + offs_s, mask=mask_s, other=float("-inf"))
    weights = tl.exp2(split_lse - tl.max(split_lse, 0))  # split 0 is never empty: the max is a real lse
    outs = tl.load(partial + (row * num_splits + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                   mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    merged = tl.sum(weights[:, None] * outs, 0) / tl.sum(weights, 0)
    tl.store(out + seq * stride_ot + head * stride_oh + offs_d, merged.to(out.dtype.element_ty), mask=mask_d)


@triton.jit
def paged_prefill_kernel(
    out, stride_ot, stride_oh, q, stride_qt, stride_qh,
    k_cache, v_cache, k_scales, v_scales, stride_slot, stride_head, scale_stride_slot,
    block_tables, stride_table, seq_lens, query_starts, query_lens, scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, QUERIES_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
    QUANT_GROUP: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (chunk, KV head, tile of QUERIES_PER_TILE query positions). A tile's rows are its
    positions x the KV head's GROUP query heads (row r: position r // GROUP, head r % GROUP), so each key and
    value tile loaded serves every query head that reads it. The chunk's queries sit after its cached context::

        positions:  0 ........ lo ........ context_len ... first ... last ... seq_len - 1
        keys read:             |<------------------------------->|              (lo: first - window + 1)
        this tile's queries:                              |<------->|

    Keys are masked per row: causal (key <= query) and windowed (key > query - window).
    """
    enter_chain(PDL)
    chunk, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_len = tl.load(query_lens + chunk)
    first = tile * QUERIES_PER_TILE
    if first < query_len:  # the grid covers the longest chunk; shorter chunks leave their last tiles idle
        seq_len = tl.load(seq_lens + chunk)
        context_len = seq_len - query_len
        offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
        query_idx = first + offs_m // GROUP
        mask_m = (offs_m < QUERIES_PER_TILE * GROUP) & (query_idx < query_len)
        mask_d = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_m % GROUP
        token_rows = (tl.load(query_starts + chunk) + query_idx).to(tl.int64)  # x a row stride: past 2**31
        row_offsets = token_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        queries = tl.load(q + row_offsets, mask=mask_m[:, None] & mask_d[None, :], other=0)
        query_pos = context_len + query_idx

        m = tl.full([BLOCK_M], NEG_INIT, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table_row = block_tables + chunk * stride_table
        lo = tl.maximum(context_len + first - window + 1, 0)
        hi = context_len + tl.minimum(first + QUERIES_PER_TILE, query_len)
        for n in range(lo, hi, BLOCK_N):
            pos = n + offs_n
            mask_n = pos < hi
            slots = _slots(table_row, pos, mask_n, PAGE_SIZE)
            keys = _load_rows(k_cache, k_scales, slots, kv_head, offs_d, mask_n, mask_d, stride_slot, stride_head,
                              scale_stride_slot, q.dtype.element_ty, QUANT, QUANT_GROUP, HEAD_DIM)
            scores = _dot(queries, tl.trans(keys), PRECISION, UPCAST_DOTS) * scale_log2
            visible = ((pos[None, :] <= query_pos[:, None]) & (pos[None, :] > query_pos[:, None] - window)
                       & mask_n[None, :])
            scores = tl.where(visible, scores, float("-inf"))
            values = _load_rows(v_cache, v_scales, slots, kv_head, offs_d, mask_n, mask_d, stride_slot,
                                stride_head, scale_stride_slot, q.dtype.element_ty, QUANT, QUANT_GROUP, HEAD_DIM)
            acc, m, l = _online_softmax_step(acc, m, l, scores, values, PRECISION, UPCAST_DOTS)

        o = acc / tl.where(l > 0, l, 1.0)[:, None]  # 0 only on padding rows: a real row sees its own key
        out_offsets = token_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out + out_offsets, o.to(out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])

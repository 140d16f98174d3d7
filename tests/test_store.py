"""Expert extents, the extents file, the three I/O modes and the bounded pool."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch

from edge0.formats import quant
from edge0.formats.extents import ALIGN, ExtentLayout
from edge0.formats.int4_layout import host_layout
from edge0.formats.writer import StreamingSafetensors
from edge0.store.expert_file import ExpertFile, tensor_name
from edge0.store.pool import ExpertPool, PoolExhausted
from helpers import mapping_field

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel

D, INTER, E, LAYERS = 128, 64, 16, 3


def mlx_group_reference(group: list[float]) -> tuple[list[int], float, float]:
    """MLX's affine 4-bit quantization of one group, written out scalar by scalar."""
    w_min, w_max = min(group), max(group)
    mask = abs(w_min) > abs(w_max)
    scale = max((w_max - w_min) / 15, 1e-7)
    scale = scale if mask else -scale
    edge = w_min if mask else w_max
    q0 = round(edge / scale)
    bias = 0.0
    if q0 != 0:
        scale, bias = edge / q0, edge
    q = [min(max(round((w - bias) / scale), 0), 15) for w in group]
    return q, scale, bias


def test_quantize_follows_the_mlx_formula():
    torch.manual_seed(0)
    w = torch.randn(32, 128) * 0.05
    w[0, :64] += 0.3  # a group whose max dominates (negative scale)
    q, scale, bias = quant.quantize_affine(w)
    for n in range(32):
        for g in range(2):
            rq, rs, rb = mlx_group_reference(w[n, g * 64 : (g + 1) * 64].double().tolist())
            got = q[n, g * 64 : (g + 1) * 64].tolist()
            assert (
                sum(a != b for a, b in zip(got, rq, strict=True)) <= 1
            )  # fp32 vs fp64 rounding ties
            assert scale[n, g].item() == torch.tensor(rs).bfloat16().item()
            assert bias[n, g].item() == torch.tensor(rb).bfloat16().item()
    # zero is exactly representable in every group (the point of snapping the scale)
    deq = quant.dequantize_affine(q, scale.float(), bias.float())
    assert (deq - w).abs().max() < 0.05


def test_extent_stores_scale_and_bias_exactly():
    layout = ExtentLayout(128, 64)
    q13 = torch.randint(0, 16, (128, 128), dtype=torch.uint8)
    q2 = torch.randint(0, 16, (128, 64), dtype=torch.uint8)
    s13, b13 = torch.randn(128, 2).bfloat16(), torch.randn(128, 2).bfloat16()
    s2, b2 = torch.randn(128, 1).bfloat16(), torch.randn(128, 1).bfloat16()
    buf = layout.pack_quantized(q13, s13, b13, q2, s2, b2)
    w13, w2 = layout.dequantize_stored(buf)
    assert torch.equal(w13, quant.dequantize_affine(q13, s13, b13))
    assert torch.equal(w2, quant.dequantize_affine(q2, s2, b2))


def test_kernel_matches_dequantized_reference():
    layout = ExtentLayout(D, INTER, host_layout())
    g, u, d = torch.randn(INTER, D), torch.randn(INTER, D), torch.randn(D, INTER)
    buf = layout.pack(g, u, d)
    layout.finalize(buf)
    t = layout.views(buf)
    w13, w2 = layout.dequantize(t)
    x = torch.randn(3, D)
    ref = x @ w13.t()
    got = quant.int4_linear(x, t.w13, t.p13).float()
    assert ((got - ref).norm() / ref.norm()) < 1e-2


def write_extents(path, seed=0):
    """An extents file whose every extent is filled with a recognisable random pattern."""
    layout = ExtentLayout(D, INTER)
    specs = [(tensor_name(layer), torch.uint8, (E, layout.nbytes)) for layer in range(LAYERS)]
    w = StreamingSafetensors(path, specs, metadata={"format": "edge0-extents"}, align=ALIGN)
    gen = torch.Generator().manual_seed(seed)
    truth = {}
    for layer in range(LAYERS):
        for e in range(E):
            b = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=gen)
            # keep the pair region valid bf16 so finalize() is well defined
            t = layout.views(b)
            t.p13.copy_(torch.randn(t.p13.shape, generator=gen))
            t.p2.copy_(torch.randn(t.p2.shape, generator=gen))
            truth[(layer, e)] = b.clone()
            w.write(tensor_name(layer), b[None])
    w.close()
    return layout, truth


def finalized(layout, b):
    b = b.clone()
    layout.finalize(b)
    return b


@pytest.mark.parametrize("mode", ["direct", "buffered", "mmap"])
def test_modes_read_exact_bytes_concurrently(tmp_path, mode):
    layout, truth = write_extents(tmp_path / "x.safetensors")
    f = ExpertFile(tmp_path / "x.safetensors", mode)
    assert f.mode == mode
    pool = ExpertPool(f, layout, capacity_bytes=layout.nbytes * E * LAYERS, io_threads=8)
    keys = list(truth)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(30):
            layer = rng.randrange(LAYERS)
            experts = sorted(rng.sample(range(E), 3))
            entries = pool.request(layer, experts)
            pool.wait(entries)
            for en in entries:
                if not torch.equal(pool._slots[en.slot], finalized(layout, truth[en.key])):
                    errors.append(en.key)
            pool.release(entries)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.stats.loads <= len(keys)
    pool.close()


def test_modes_agree(tmp_path):
    layout, _ = write_extents(tmp_path / "x.safetensors", seed=3)
    seen = {}
    for mode in ("direct", "buffered", "mmap"):
        pool = ExpertPool(ExpertFile(tmp_path / "x.safetensors", mode), layout, layout.nbytes * E)
        entries = pool.request(1, list(range(E)))
        pool.wait(entries)
        seen[mode] = torch.stack([pool._slots[en.slot].clone() for en in entries])
        assert pool.stats.reads == 1  # consecutive experts: one preadv
        pool.close()
    assert torch.equal(seen["direct"], seen["buffered"]) and torch.equal(
        seen["direct"], seen["mmap"]
    )


def test_pool_never_exceeds_its_budget(tmp_path):
    layout, truth = write_extents(tmp_path / "x.safetensors")
    budget = layout.nbytes * 7 + 123  # not a whole number of slots
    pool = ExpertPool(
        ExpertFile(tmp_path / "x.safetensors", "buffered"), layout, budget, io_threads=4
    )
    assert pool.capacity_bytes <= budget
    lock = threading.Lock()
    peak = [0]
    bad = []

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(200):
            layer = rng.randrange(LAYERS)
            experts = rng.sample(range(E), rng.randint(1, 2))
            try:
                entries = pool.request(layer, experts)
            except PoolExhausted:
                continue
            with lock:
                peak[0] = max(peak[0], pool.resident_bytes)
            pool.wait(entries)
            for en in entries:
                if not torch.equal(pool._slots[en.slot], finalized(layout, truth[en.key])):
                    bad.append(en.key)
            pool.release(entries)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert 0 < peak[0] <= budget
    assert pool.stats.evictions > 0  # the budget was actually binding
    # the O(1) count of evictable slots agrees with a full scan after all that churn
    scan = len(pool._free) + sum(1 for e in pool._entries.values() if e.pins == 0)
    assert pool.available() == scan == pool.num_slots
    pool.close()


def test_pool_refuses_more_pins_than_slots(tmp_path):
    layout, _ = write_extents(tmp_path / "x.safetensors")
    pool = ExpertPool(ExpertFile(tmp_path / "x.safetensors", "buffered"), layout, layout.nbytes * 4)
    held = pool.request(0, [0, 1, 2])
    with pytest.raises(PoolExhausted, match="Raise memory_budget"):
        pool.request(0, [3, 4])
    pool.release(held)
    pool.wait(pool.request(0, [3, 4]))  # evicts unpinned entries now
    pool.close()


def test_truncated_extents_file_is_named(tmp_path):
    write_extents(tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="x.safetensors: truncated"):
        ExpertFile(tmp_path / "x.safetensors")


def test_a_peek_gives_loaded_experts_unpinned_and_keeps_them_recent(tmp_path):
    """ExpertPool.peek: None unless every expert asked for is loaded (one missing, or a read
    still in flight); else their bytes, nothing pinned, each made the most recently used, so
    the next eviction takes an older entry."""
    layout, truth = write_extents(tmp_path / "x.safetensors")
    pool = ExpertPool(ExpertFile(tmp_path / "x.safetensors", "buffered"), layout, layout.nbytes * 3)
    assert pool.peek(0, [0]) is None
    gate = threading.Event()
    read = pool.file.read_run
    pool.file.read_run = lambda *a: (gate.wait(), read(*a))[1]
    arriving = pool.request(0, [0, 1, 2])
    assert pool.peek(0, [0]) is None  # pinned and arriving, not loaded
    gate.set()
    pool.wait(arriving)
    pool.release(arriving)
    assert pool.peek(1, [0]) is None and pool.peek(0, [2, 5]) is None
    got = pool.peek(0, [2, 0])
    assert [t.w13.data_ptr() for t in got] == [
        pool._entries[(0, e)].tensors.w13.data_ptr() for e in (2, 0)
    ]
    for e in (2, 0):
        slot = pool._entries[(0, e)].slot
        assert torch.equal(pool._slots[slot], finalized(layout, truth[(0, e)]))
    assert pool.available() == pool.num_slots  # nothing pinned
    pool.wait(pool.request(0, [3]))  # evicts the least recently used: 1, not the peeked
    assert (0, 1) not in pool._entries and {(0, 0), (0, 2)} <= set(pool._entries)
    pool.close()


def vm_flags(address: int) -> list[str]:
    return mapping_field(address, "VmFlags")


def test_fault_in_backs_every_slot_with_memory_before_any_read(tmp_path):
    """The pool's memory is resident once fault_in returns (so no slot's first read pays
    its page faults during decode), and reads into those pages land exactly."""
    layout, truth = write_extents(tmp_path / "x.safetensors")
    pool = ExpertPool(ExpertFile(tmp_path / "x.safetensors", "direct"), layout, 8 << 20)
    try:
        address = pool._slots.data_ptr()
        before = int(mapping_field(address, "Rss")[0]) << 10
        pool.fault_in()
        after = int(mapping_field(address, "Rss")[0]) << 10
        assert after - before >= pool.capacity_bytes - (64 << 10)  # (a partial last page)
        entries = pool.request(1, [0, 2, 3])
        pool.wait(entries)
        for en in entries:
            assert torch.equal(pool._slots[en.slot], finalized(layout, truth[en.key]))
        pool.release(entries)
    finally:
        pool.close()


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.skipif(
    not os.path.exists(THP) or "[never]" in open(THP).read(),
    reason="no transparent huge pages on this kernel",
)
def test_the_pool_asks_for_huge_pages(tmp_path):
    layout, _ = write_extents(tmp_path / "x.safetensors")
    pool = ExpertPool(ExpertFile(tmp_path / "x.safetensors", "buffered"), layout, layout.nbytes * E)
    try:
        assert "hg" in vm_flags(pool._slots.data_ptr())  # madvise(MADV_HUGEPAGE) took
        entries = pool.request(0, list(range(E)))  # and reads still land exactly
        pool.wait(entries)
        assert pool.stats.loads == E
        pool.release(entries)
    finally:
        pool.close()

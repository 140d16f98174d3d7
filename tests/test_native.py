"""The native decode ops (fused experts, a decoder layer's norms and attention): the engine
decodes bit-identically with them, they take only the layers they compute exactly, and a
machine that cannot build them is told why and served by the pure-PyTorch paths."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from edge0 import builtin, native
from edge0.convert import convert
from edge0.engine import backends
from edge0.engine.backends import native_layers
from edge0.engine.backends.base import ExpertOps
from edge0.engine.backends.native import NativeBackend, NativeExperts
from edge0.engine.backends.torch import TorchBackend, TorchExperts, swiglu_int4
from edge0.engine.load import load_engine
from edge0.engine.options import EngineOptions
from edge0.formats import int4_layout, quant
from edge0.formats.extents import ExpertTensors, ExtentLayout
from helpers import decode_logits, rows_logits

pytestmark = pytest.mark.int4  # `make test` repeats these under every CPU kernel


def native_ops(int8: bool = False, arrangement=None) -> NativeExperts:
    """The native backend's expert ops for codes in `arrangement` (the host's by default)."""
    backend = NativeBackend(EngineOptions(int4_activations="int8" if int8 else "bf16"))
    return backend.expert_ops(arrangement or int4_layout.host_layout())


def each_token(ops: ExpertOps, x, indices, tensors) -> torch.Tensor:
    """Every token of x [T, D] through its experts `indices` [T, K] with ops.token -> [T, K, D]."""
    rows = indices.tolist()
    return torch.stack(
        [ops.token(x[t : t + 1], [tensors[e] for e in r]) for t, r in enumerate(rows)]
    )


def greedy_logits(
    kernel: str,
    no_prerouter: bool,
    steps: int = 12,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = EngineOptions.kv_dtype,
) -> torch.Tensor:
    opts = EngineOptions(
        io_mode="buffered",
        backend=kernel,
        no_prerouter=no_prerouter,
        prerouter_always=not no_prerouter,
        dtype=dtype,
        kv_dtype=kv_dtype,
        int4_activations="bf16",  # the exact option: what the torch backend computes
    )
    engine = load_engine(builtin.model_dir(), opts)
    try:
        if kernel == "native":  # the op computes every layer, LoRA'd projections included
            assert sorted(engine.layers) == list(range(len(engine.model.backbone.layers)))
        with engine.new_request() as req:
            logits = [engine.prefill(req, engine.tokenizer.encode("def read_config(path):"))]
            for _ in range(steps):
                logits.append(engine.step(req, int(logits[-1].argmax())))
        return torch.stack(logits)
    finally:
        engine.close()


@pytest.mark.parametrize("no_prerouter", [False, True], ids=["staged", "exact"])
def test_engine_decodes_bit_identically_with_either_kernel(no_prerouter):
    """The built-in model: float attention projections under LoRA, experts int4."""
    torch.manual_seed(0)
    assert torch.equal(greedy_logits("native", no_prerouter), greedy_logits("torch", no_prerouter))


def test_engine_decodes_bit_identically_with_either_kernel_in_bf16():
    """The same in bf16: the fp32 adapters' delta rounded to bf16, then scaled and added in
    it, as LoraLinear does."""
    torch.manual_seed(0)
    fused = greedy_logits("native", True, dtype=torch.bfloat16)
    assert torch.equal(fused, greedy_logits("torch", True, dtype=torch.bfloat16))


def int4_weights(n: int, k: int, gen: torch.Generator, layout=None, tiny_zero=False):
    """Random codes and kernel pairs [K/64, N, 2] for an [n, k] int4 matrix, packed as
    `layout` (the host's by default). `tiny_zero`: zeros ~2^-10 of their scale, so a weight
    needs ~21 bits and its product with an activation rounds."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 64, generator=gen) * 0.01 + 0.01
    zero = scale * torch.randn(n, k // 64, generator=gen) * (2**-10 if tiny_zero else 4.0)
    pairs = torch.stack([scale.t(), zero.t()], dim=-1).bfloat16().contiguous()
    return q, (layout or int4_layout.host_layout()).pack(q), pairs


@pytest.mark.parametrize("tiny_zero", [False, True], ids=["zero", "tiny-zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int4_kernel_computes_torchs_bit_for_bit(dtype, tiny_zero):
    """edge0's int4 kernel, on the path of torch's CPU capability, against
    aten._weight_int4pack_mm_for_cpu: a 32-row tail block (96 rows: on AVX-512 one block of
    64 and a tail of 32), one group, odd group counts, fp32 and bf16 rows. 1, 3 and 8 rows
    take the block kernels; 9, 13 and 45 (a job of 32 and one of 13) AVX-512's tiled one."""
    gen = torch.Generator().manual_seed(0)
    op = native.op("int4_gemv")
    layout, isa = native.kernel_args()
    for n, k in [(96, 64), (256, 512), (160, 192), (1024, 1024)]:
        _, packed, pairs = int4_weights(n, k, gen, tiny_zero=tiny_zero)
        for rows in (1, 3, 8, 9, 13, 45):
            x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
            ref = quant.int4_linear(x, packed, pairs).to(dtype)
            got = op(x, packed, pairs, layout, isa)
            assert got.dtype == dtype and got.shape == (rows, n)
            assert torch.equal(got, ref), (n, k, rows)


def test_the_int4_kernel_reads_every_arrangement():
    """The same codes packed in each known arrangement (torch picks one per CPU capability)
    give the same result on each path this CPU runs: the paths do not assume their own."""
    gen = torch.Generator().manual_seed(1)
    op = native.op("int4_gemv")
    _, isa = native.kernel_args()
    q, packed, pairs = int4_weights(96, 128, gen)
    x = torch.randn(2, 128, generator=gen)
    want = op(x, packed, pairs, *native.kernel_args())
    paths = [i for i in range(len(native.ISA_PATHS)) if torch.ops.edge0.int4_isa_supported(i)]
    assert isa in paths
    for layout in int4_layout.LAYOUTS.values():
        for path in paths:
            got = op(x, layout.pack(q), pairs, native.layout_code(layout), path)
            # the paths mirror different capabilities' arithmetic, which bf16 rounding of
            # exact products leaves equal on these weights
            assert torch.equal(got, want), (layout.name, native.ISA_PATHS[path])
    with pytest.raises(RuntimeError, match="isa is 0 \\(portable\\), 1 \\(AVX2\\) or 2"):
        op(x, packed, pairs, native.layout_code(int4_layout.host_layout()), 3)
    with pytest.raises(RuntimeError, match="do not take 64 inputs"):
        op(x[:, :64], packed, pairs, *native.kernel_args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_experts_are_the_reference_bit_for_bit(dtype):
    """A token's 8 experts in one call of the native op against the torch backend's (one
    expert at a time in PyTorch ops), for each of three tokens."""
    gen = torch.Generator().manual_seed(2)
    d, width = 256, 128
    tensors = {}
    for e in range(16):
        w13 = int4_weights(2 * width, d, gen)
        w2 = int4_weights(d, width, gen)
        tensors[e] = ExpertTensors(w13[1], w13[2], w2[1], w2[2])
    x = torch.randn(3, d, generator=gen).to(dtype)
    indices = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(3)])
    want = each_token(TorchExperts(), x, indices, tensors)
    assert torch.equal(each_token(native_ops(), x, indices, tensors), want)


def random_experts(n_exp: int, d: int, width: int, gen: torch.Generator):
    """n_exp random int4 experts: their kernel tensors and their codes (q13, q2), by index."""
    tensors, codes = {}, {}
    for e in range(n_exp):
        q13, w13, p13 = int4_weights(2 * width, d, gen)
        q2, w2, p2 = int4_weights(d, width, gen)
        tensors[e], codes[e] = ExpertTensors(w13, p13, w2, p2), (q13, q2)
    return tensors, codes


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_fused_experts_are_the_same_bits_however_the_threads_split_them(threads):
    """Where the threads can share a token's K experts evenly, each takes whole experts in
    one region; else every block is shared out, gate/up then down. K of 8, 6 and 3 on 1, 2
    and 3 threads give both, and each is the reference bit for bit: the torch backend's on
    the exact path (fp32 and bf16), swiglu_int8 on the int8 one."""
    gen = torch.Generator().manual_seed(12)
    d, width, n_exp = 256, 128, 10
    tensors, codes = random_experts(n_exp, d, width, gen)
    exact, int8, reference = native_ops(), native_ops(int8=True), TorchExperts()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (8, 6, 3):
            indices = torch.randperm(n_exp, generator=gen)[:k][None]
            x = torch.randn(1, d, generator=gen) * 2
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to(dtype)
                want = each_token(reference, xd, indices, tensors)
                assert torch.equal(each_token(exact, xd, indices, tensors), want)
            want = torch.cat([swiglu_int8(x, codes[e], tensors[e]) for e in indices[0].tolist()])
            assert torch.equal(each_token(int8, x, indices, tensors), want[None])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [128, 192])
def test_the_prefill_experts_are_the_reference_bit_for_bit(dtype, width):
    """Prefill's experts in one native call (NativeExperts.rows), each on its tokens, against
    swiglu_int4 one expert at a time: 40 tokens routed to 4 of 12 experts each (one expert
    gets none), expert widths of 2 and 3 quantization groups."""
    gen = torch.Generator().manual_seed(5)
    d, n_exp = 256, 12
    tensors = []
    for _ in range(n_exp):
        w13 = int4_weights(2 * width, d, gen)
        w2 = int4_weights(d, width, gen)
        tensors.append(ExpertTensors(w13[1], w13[2], w2[1], w2[2]))
    x = (torch.randn(40, d, generator=gen) * 2).to(dtype)
    indices = torch.stack([torch.randperm(n_exp - 1, generator=gen)[:4] for _ in range(40)])
    groups = [(torch.nonzero((indices == e).any(-1)).flatten(), tensors[e]) for e in range(n_exp)]
    assert groups[-1][0].numel() == 0
    rows = native_ops().rows
    got = rows(x, groups)
    want = torch.cat([swiglu_int4(x[tok], t) for tok, t in groups])
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="is not a row of x"):
        rows(x, [(torch.tensor([40]), tensors[0])])


def arrangements() -> list[int4_layout.Int4Layout]:
    """Every arrangement the int4 kernels read, each also in its int8 order."""
    own = list(int4_layout.LAYOUTS.values())
    return own + [layout.in_int8_order() for layout in own]


def int8_paths() -> list[int]:
    """The int8 kernels' codes this CPU runs (their portable, AVX2 and AVX-512 paths)."""
    return [
        native.INT8 + i
        for i in range(len(native.ISA_PATHS))
        if torch.ops.edge0.int4_isa_supported(i)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_kernels_are_their_reference_bit_for_bit(dtype):
    """The int8-activation kernels against quant.int4_linear_int8 (its exact integer sums and
    fp32 steps in PyTorch), on every path this CPU runs and every arrangement: blocks of 64
    and 32 rows (96 rows: a 64 and a 32 tail on AVX-512), one and 16 groups, 1 to 9 rows, a
    group 1000x larger than the rest, a group of zeros. The paths' bits are the same, so the
    int8 decode computes the same on every CPU."""
    gen = torch.Generator().manual_seed(7)
    op = native.op("int4_gemv")
    paths = int8_paths()
    assert len(paths) >= 1 and native.kernel_args(True)[1] in paths
    for n, k in [(96, 64), (256, 1024), (160, 192)]:
        q, _, pairs = int4_weights(n, k, gen)
        for rows in (1, 2, 4, 5, 9):
            x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
            x[0, :64] *= 1000
            if k > 64:
                x[-1, 64:128] = 0
            want = quant.int4_linear_int8(x, q, pairs).to(dtype)
            for layout in arrangements():
                for path in paths:
                    got = op(x, layout.pack(q), pairs, native.layout_code(layout), path)
                    assert got.dtype == dtype and torch.equal(got, want), (n, k, rows, path)
    # what an int8 product gives up against the exact one: ~2x bf16's rounding error
    q, packed, pairs = int4_weights(512, 1024, gen)
    x = torch.randn(4, 1024, generator=gen)
    exact = x.double() @ int4_layout.host_layout().dequantize(packed, pairs, 512, 1024).double().T
    for isa in native.kernel_args()[1], native.kernel_args(True)[1]:
        got = op(x, packed, pairs, native.kernel_args()[0], isa).double()
        assert (got - exact).norm() / exact.norm() < 1e-2
    bad = x.clone()
    bad[1, 3] = float("nan")
    got = op(bad, packed, pairs, *native.kernel_args(True))
    assert got[1].isnan().all() and not got[[0, 2, 3]].isnan().any()


def test_the_int8_order_is_its_reference_and_only_the_int8_paths_read_it():
    """The native op puts codes in the int8 order exactly as Int4Layout.in_int8_order packs
    them (every arrangement, blocks of 64 with a tail of 32 too), the order's bytes differ
    from their own arrangement's, and an exact path refuses them with an error that says so."""
    gen = torch.Generator().manual_seed(12)
    reorder = native.op("int8_order_")
    for layout in int4_layout.LAYOUTS.values():
        for n, k in [(96, 64), (256, 1024), (160, 192)]:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            ordered = layout.in_int8_order()
            got = layout.pack(q)
            reorder(got, native.layout_code(layout))
            assert torch.equal(got, ordered.pack(q)) and torch.equal(ordered.unpack(got, n, k), q)
            assert not torch.equal(got, layout.pack(q))
    # the pool's finalize of a stored extent: its codes in the int8 order, its weights the same
    host = int4_layout.host_layout()
    stored = ExtentLayout(128, 64).with_int4(host)
    gate, up = torch.randn(2, 64, 128, generator=gen).unbind()
    buf = stored.pack(gate, up, torch.randn(128, 64, generator=gen))
    as_stored, ordered_buf = buf.clone(), buf.clone()
    stored.finalize(as_stored)
    ordered = stored.with_int4(host.in_int8_order())
    with pytest.raises(ValueError, match="int8 order need a reorder"):
        ordered.finalize(buf.clone(), host)
    ordered.finalize(ordered_buf, host, native.put_in_int8_order)
    for a, b in zip(
        stored.dequantize(stored.views(as_stored)),
        ordered.dequantize(ordered.views(ordered_buf)),
        strict=True,
    ):
        assert torch.equal(a, b)
    assert not torch.equal(ordered.views(ordered_buf).w13, stored.views(as_stored).w13)
    q, _, pairs = int4_weights(64, 128, gen)
    ordered = host.in_int8_order()
    x = torch.randn(1, 128, generator=gen)
    with pytest.raises(RuntimeError, match="int8 order are read by the int8 kernels only"):
        native.op("int4_gemv")(
            x, ordered.pack(q), pairs, native.layout_code(ordered), native.kernel_isa()
        )


def test_the_native_pair_fixup_is_torchs_on_every_bit_pattern():
    """The pool's fix-up of a read's scale pairs (native.to_kernel_pairs) gives what
    quant.to_kernel_pairs gives: every one of the 2^32 (scale, bias) bit patterns would be
    too many, so every scale against a spread of biases, and every bias against a spread
    of scales (zeros, subnormals, infinities, NaNs and rounding ties among them); a NaN
    result is a NaN either way (its payload is not defined)."""
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    gen = torch.Generator().manual_seed(3)
    some = torch.randint(-(1 << 15), 1 << 15, (11,), dtype=torch.int32, generator=gen)
    special = torch.tensor([0, 1, -1, 0x7F80, 0x0080], dtype=torch.int16)  # 0, subnormal, NaN..
    some = torch.cat([some.to(torch.int16), special])
    scales = torch.cat([every.repeat_interleave(len(some)), some.repeat(1 << 16)])
    biases = torch.cat([some.repeat(1 << 16), every.repeat_interleave(len(some))])
    raw = torch.stack([scales, biases], -1).view(torch.bfloat16)  # [N, 2]
    for n in (raw.shape[0], 7, 1):  # the vector loop, and tails shorter than a vector
        want, got = raw[:n].clone(), raw[:n].clone()
        quant.to_kernel_pairs(want)
        native.to_kernel_pairs(got)
        nan = want.isnan()
        assert torch.equal(nan, got.isnan())
        assert torch.equal(want.view(torch.int16)[~nan], got.view(torch.int16)[~nan])
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        native.to_kernel_pairs(raw.float())


def test_the_engines_pool_fixes_pairs_natively_with_the_same_weights(tmp_path):
    """A pool read finalized with the native fix-up holds the same bytes as one finalized
    with the torch ops; the engine hands the pool the native one where its ops run."""
    host = int4_layout.host_layout()
    layout = ExtentLayout(128, 64).with_int4(host)
    gen = torch.Generator().manual_seed(4)
    gate, up = torch.randn(2, 64, 128, generator=gen).unbind()
    buf = layout.pack(gate, up, torch.randn(128, 64, generator=gen))
    a, b = buf.clone(), buf.clone()
    layout.finalize(a)
    layout.finalize(b, kernel_pairs=native.to_kernel_pairs)
    assert torch.equal(a, b) and not torch.equal(a, buf)
    engine = load_engine(builtin.model_dir(), EngineOptions(backend="native"))
    try:
        assert engine.pool._kernel_pairs is native.to_kernel_pairs
    finally:
        engine.close()
    engine = load_engine(builtin.model_dir(), EngineOptions(backend="torch"))
    try:
        assert engine.pool._kernel_pairs is quant.to_kernel_pairs
    finally:
        engine.close()


def test_fake_quantized_activations_price_what_the_int8_kernels_compute():
    """edge0 eval's int8 arm multiplies the dequantized weights by the activations as the
    int8 kernels quantize them; that is their reference's product up to float sums and its
    bf16 rounding, and farther from the float product than bf16 activations are."""
    gen = torch.Generator().manual_seed(11)
    q, packed, pairs = int4_weights(256, 512, gen)
    w = int4_layout.host_layout().dequantize(packed, pairs, 256, 512)
    x = torch.randn(5, 512, generator=gen) * 3
    want = quant.int4_linear_int8(x, q, pairs).float()
    got = quant.fake_quantize_activations(x) @ w.T
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    exact = x @ w.T
    bf16 = x.bfloat16().float() @ w.T
    assert (got - exact).norm() > 1.2 * (bf16 - exact).norm()
    assert (got - exact).norm() / exact.norm() < 1e-2


def swiglu_int8(x: torch.Tensor, codes: tuple[torch.Tensor, torch.Tensor], t: ExpertTensors):
    """One expert on its tokens as the int8 kernels compute it (the reference of the native
    experts' int8 path): x [n, D] -> fp32 [n, D]."""
    gate, up = quant.int4_linear_int8(x, codes[0], t.p13).float().chunk(2, dim=-1)
    return quant.int4_linear_int8(F.silu(gate) * up, codes[1], t.p2).float()


def test_the_int8_experts_are_their_reference_bit_for_bit():
    """A decode token's 8 experts (NativeExperts.token) and prefill's experts on their
    tokens (rows) through the int8 kernels, against swiglu_int8 one expert at a time."""
    gen = torch.Generator().manual_seed(8)
    d, width, n_exp = 256, 192, 12
    tensors, codes = random_experts(n_exp, d, width, gen)
    x = torch.randn(3, d, generator=gen) * 2
    indices = torch.stack([torch.randperm(n_exp, generator=gen)[:8] for _ in range(3)])
    fused = native_ops(int8=True)
    assert fused.isa >= native.INT8
    want = torch.stack(
        [
            torch.cat([swiglu_int8(x[t : t + 1], codes[e], tensors[e]) for e in row])
            for t, row in enumerate(indices.tolist())
        ]
    )
    groups = [(torch.nonzero((indices == e).any(-1)).flatten(), e) for e in range(n_exp)]
    rows_want = torch.cat([swiglu_int8(x[tok], codes[e], tensors[e]) for tok, e in groups])
    assert torch.equal(each_token(fused, x, indices, tensors), want)
    got = fused.rows(x, [(tok, tensors[e]) for tok, e in groups])
    assert torch.equal(got, rows_want)
    # the same experts in the int8 order, as the pool holds them for the int8 AVX2 kernel
    ordered = int4_layout.host_layout().in_int8_order()
    fused = native_ops(int8=True, arrangement=ordered)
    assert fused.layout == native.layout_code(ordered) and fused.layout[-1] == 1
    tensors = {
        e: ExpertTensors(ordered.pack(codes[e][0]), t.p13, ordered.pack(codes[e][1]), t.p2)
        for e, t in tensors.items()
    }
    assert torch.equal(each_token(fused, x, indices, tensors), want)
    got = fused.rows(x, [(tok, tensors[e]) for tok, e in groups])
    assert torch.equal(got, rows_want)


def test_the_engine_decodes_int8_within_its_stated_tolerance():
    """The built-in model's decode with int8 activations against bf16 ones (the default),
    teacher-forced on the bf16 run's greedy tokens: the next-token distributions stay within
    a mean KL of 2e-3 nats and the argmax agrees on 90% of steps or more (measured: KL
    2-5e-4, 98.5-99.7% over 400 tokens of three texts, docs/kernels.md), and the options say
    which ran."""
    steps = 24
    runs = {}
    tokens = None
    for act in ("bf16", "int8"):
        engine = load_engine(
            builtin.model_dir(), EngineOptions(io_mode="buffered", int4_activations=act)
        )
        try:
            assert engine.options.int4_activations == act
            with engine.new_request() as req:
                logits = [engine.prefill(req, engine.tokenizer.encode("def read_config(path):"))]
                if tokens is None:
                    for _ in range(steps):
                        logits.append(engine.step(req, int(logits[-1].argmax())))
                    tokens = [int(t.argmax()) for t in logits[:-1]]
                else:
                    for t in tokens:
                        logits.append(engine.step(req, t))
            runs[act] = torch.log_softmax(torch.stack(logits).float().reshape(steps + 1, -1), -1)
        finally:
            engine.close()
    a, b = runs["bf16"], runs["int8"]
    assert not torch.equal(a, b)  # the two kernels ran
    kl = (a.exp() * (a - b)).sum(-1).mean()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    assert kl < 2e-3 and agree >= 0.9, (kl, agree)


def test_the_pool_holds_int8_order_where_it_pays_and_decodes_the_same(monkeypatch):
    """An int8 engine whose pool puts experts in the int8 order as it reads them (where the
    int8 path is AVX2, or forced here) decodes the built-in model to the same logits, bit for
    bit, as one that keeps them in the host's arrangement; a bf16 engine, and one whose pool
    cannot hold every expert, keep them as stored."""
    runs = {}
    for ordered in (False, True):
        monkeypatch.setattr(native, "int8_order_pays", lambda ordered=ordered: ordered)
        engine = load_engine(
            builtin.model_dir(), EngineOptions(io_mode="buffered", int4_activations="int8")
        )
        try:
            assert engine.pool.layout.int4.int8_order is ordered
            assert engine.experts.layout == native.layout_code(engine.pool.layout.int4)
            with engine.new_request() as req:
                logits = [engine.prefill(req, engine.tokenizer.encode("def read_config(path):"))]
                for _ in range(8):
                    logits.append(engine.step(req, int(logits[-1].argmax())))
            runs[ordered] = torch.stack(logits)
        finally:
            engine.close()
    assert torch.equal(runs[False], runs[True])
    exact = EngineOptions(io_mode="buffered", int4_activations="bf16")
    engine = load_engine(builtin.model_dir(), exact)
    try:
        assert not engine.pool.layout.int4.int8_order  # monkeypatched to pay, but bf16
        experts_bytes = engine.plan.experts_bytes
    finally:
        engine.close()
    small = EngineOptions(
        io_mode="buffered", int4_activations="int8", expert_cache=experts_bytes // 2
    )
    engine = load_engine(builtin.model_dir(), small)
    try:  # a pool that reads experts again and again keeps them as stored
        assert not engine.plan.holds_every_expert and not engine.pool.layout.int4.int8_order
    finally:
        engine.close()


def test_int8_activations_are_checked_and_the_torch_path_is_bf16():
    with pytest.raises(ValueError, match="int4_activations must be one of int8, bf16"):
        load_engine(builtin.model_dir(), EngineOptions(int4_activations="int4"))
    engine = load_engine(builtin.model_dir(), EngineOptions(backend="torch"))
    try:
        assert engine.options.int4_activations == "bf16"
    finally:
        engine.close()


def lm_head_inputs(engine, alone: bool = False) -> list[torch.Tensor]:
    """rows_logits's steps: every row's input to the LM head, one [D] each."""
    seen, logits = [], engine.model.logits

    def lm_head(x):
        seen.append(x.reshape(-1, x.shape[-1]).clone())
        return logits(x)

    engine.model.logits = lm_head
    try:
        rows_logits(engine, alone=alone)
    finally:
        del engine.model.logits
    return [row for x in seen for row in x]


def test_a_batched_steps_attention_is_the_module_paths_bit_for_bit():
    """A batched step's attention in one native call (attend_rows) and row by row in the
    module path (the decoder layers' own forwards): the same logits, bit for bit."""
    opts = EngineOptions(io_mode="buffered", max_active=8, prerouter_always=True)
    engine = load_engine(builtin.model_dir(), opts)
    try:
        assert engine.attend_rows is not None
        layers, engine.layers = engine.layers, {}
        native_rows = rows_logits(engine)
        op, engine.attend_rows = engine.attend_rows, None
        reference = rows_logits(engine)
        engine.attend_rows, engine.layers = op, layers
        assert all(torch.equal(a, b) for a, b in zip(native_rows, reference, strict=True))
    finally:
        engine.close()


@pytest.mark.parametrize(
    "model, dtype, activations",
    [
        ("builtin", torch.float32, "bf16"),
        ("int4", torch.float32, "bf16"),
        ("int4", torch.bfloat16, "bf16"),
    ],
    ids=["builtin", "int4", "int4-bf16"],
)
def test_a_batched_steps_layers_are_the_module_paths_bit_for_bit(
    int4_model, model, dtype, activations
):
    """A batched step's decoder layers through the native ops (attention_rows for every row's
    norms and attention, then the block's routing and experts for all rows) compute each row
    as the modules' own forwards compute that row's step alone: the same input to the LM
    head, bit for bit, on the built-in model (float projections under LoRA, predictions as
    routing) and on one with int4 q/k/v/o and q/k norm per head, in either compute dtype.
    (With int8 activations the rows' projections take the int8 kernel each row's own step
    takes, which the module path has not: tests/test_scheduling.py holds a row stepped with
    others to its own step.)"""
    path = builtin.model_dir() if model == "builtin" else int4_model
    opts = EngineOptions(
        io_mode="buffered",
        max_active=8,
        dtype=dtype,
        int4_activations=activations,
        prerouter_always=model == "builtin",
    )
    engine = load_engine(path, opts)
    try:
        layers = engine.layers
        assert sorted(layers) == list(range(len(engine.model.backbone.layers)))
        calls = []
        for layer in layers.values():
            op = layer.op

            def counted(x, *args, op=op):
                calls.append(x.shape[0])
                return op(x, *args)

            layer.op = counted
        # the layers one by one: no token decoder (its batched step: test_native_token.py)
        engine.token, token = None, engine.token
        native_rows = lm_head_inputs(engine)
        assert calls == [3] * len(layers) * 6
        engine.layers = {}  # the module path's step
        reference = lm_head_inputs(engine, alone=True)
        engine.layers, engine.token = layers, token
        assert len(native_rows) == len(reference) == 3 + 3 * 6  # the prompts, then the steps
        assert all(torch.equal(a, b) for a, b in zip(native_rows, reference, strict=True))
    finally:
        engine.close()


def test_the_engine_prefills_bit_identically_with_the_native_experts(monkeypatch):
    """The built-in model's prefill, a short prompt, a long one (some experts take the dense
    path: from 96 tokens here on both paths) and seven prompts in one batch, with and without
    the native backend's rows (with the exact option's bf16 activations)."""
    opts = EngineOptions(
        io_mode="buffered", max_active=8, prerouter_always=True, int4_activations="bf16"
    )
    engine = load_engine(builtin.model_dir(), opts)
    try:
        assert isinstance(engine.experts, NativeExperts)
        engine.experts.dense_from = TorchExperts.dense_from
        tok = engine.tokenizer
        short = tok.encode("def read_config(path):")
        long = tok.encode("import os\nimport sys\n" * 40)
        batch = [tok.encode(f"class Stack{i}:\n    def push(self, x):") for i in range(7)]

        def logits() -> list[torch.Tensor]:
            out = []
            for ids in (short, long):
                with engine.new_request() as req:
                    out.append(engine.prefill(req, ids))
            reqs = [engine.new_request() for _ in batch]
            out += engine.prefill_together(reqs, batch)
            for req in reqs:
                req.release()
            return out

        dense = []
        on_weights = ExpertOps.dense
        monkeypatch.setattr(ExpertOps, "dense", lambda *a: dense.append(1) or on_weights(*a))
        native_rows = logits()
        assert dense  # the long prompt's busiest experts took the dense path
        engine.experts = TorchExperts()
        reference = logits()
        assert all(torch.equal(a, b) for a, b in zip(native_rows, reference, strict=True))
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1024, 128, 7, 100, 2067, 40000])
def test_the_native_norm_is_the_modules_bit_for_bit(n, dtype):
    """edge0.rms_norm with the width sum_lanes found equals layers.py RMSNorm bit for bit:
    rows short of a vector, with leftover vectors and floats, and long enough (40,000) for the
    sum's second level; large values, where the order of additions shows in the bits."""
    from edge0.models.layers import RMSNorm

    lanes = native_layers.sum_lanes()
    assert lanes in native_layers.SUM_LANES
    gen = torch.Generator().manual_seed(n)
    norm = RMSNorm(n, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=gen))
        for scale in (1.0, 1e3):
            x = (torch.randn(3, 2, n, generator=gen) * scale).to(dtype)
            got = native.op("rms_norm")(x, norm.weight, norm.eps, lanes)
            assert got.dtype == dtype and torch.equal(got, norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, d", [(2, 256), (8, 1024), (17, 100), (40, 1035)])
def test_the_native_combine_is_the_blocks_bit_for_bit(k, d, dtype):
    """edge0.moe_combine equals MoEBlock's weighted sum, its shared expert and the layer's
    residual bit for bit: K past the sum's first level (17, 40), widths that leave vectors and
    floats after the last run of four vectors (100, 1035)."""
    gen = torch.Generator().manual_seed(k * d)
    routed = (torch.randn(1, k, d, generator=gen) * 1e2).to(dtype)
    weights = torch.rand(1, k, generator=gen)
    x = torch.randn(1, 1, d, generator=gen).to(dtype)
    shared = torch.randn(1, d, generator=gen).to(dtype)
    op, lanes = native.op("moe_combine"), native_layers.sum_lanes()
    for s in (None, shared):
        y = (routed * weights[..., None].to(dtype)).sum(dim=1)
        ref = x + (y if s is None else y + s).view(1, 1, d)
        got = op(routed, weights, x, s, lanes)
        assert got.shape == ref.shape and torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, d", [(64, 1024), (128, 2048), (256, 512), (96, 256), (60, 2048)])
def test_the_native_router_is_the_modules_linear_bit_for_bit(experts, d, dtype):
    """edge0.router_topk's logits are F.linear's bit for bit, on the first call of a shape
    (which checks whether two threads' halves of the outputs agree with the whole) and on every
    call after it (which uses the halves where they did); 60 experts never split (halves of
    30: another kernel path in MKL's sums)."""
    gen = torch.Generator().manual_seed(experts + d)
    w = torch.randn(experts, d, generator=gen).to(dtype)
    op = native.op("router_topk")
    for _ in range(3):
        h = torch.randn(1, d, generator=gen).to(dtype)
        with torch.inference_mode():
            logits, weights, indices = op(h, [w], 0.0, 8, True, None)
            ref = torch.nn.functional.linear(h, w)
        assert torch.equal(logits, ref)
        assert torch.equal(indices[0].sort().values, ref[0].float().topk(8).indices.sort().values)


def test_the_norms_sum_width_is_checked_not_assumed():
    """Of the widths sum_lanes tries, only the one it found computes ATen's sums here: the
    comparison tells them apart (a width that is not the reduction's gives other bits)."""
    from edge0.models.layers import RMSNorm

    lanes = native_layers.sum_lanes()
    norm = RMSNorm(1024, 1e-6)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(3)) * 1e3
    with torch.no_grad():
        ref = norm(x)
    for other in native_layers.SUM_LANES:
        assert torch.equal(native.op("rms_norm")(x, norm.weight, 1e-6, other), ref) == (
            other == lanes
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_layer_serves_int4_layers_bit_identically(int4_model, dtype):
    """Every layer's norms and attention (int4 q/k/v/o, q/k norm per head) run through the
    native op at decode, and the logits are those of the pure-PyTorch path, bit for bit, in
    either compute dtype."""
    fused, served = decode_logits(int4_model, "native", dtype)
    reference, none = decode_logits(int4_model, "torch", dtype)
    assert sorted(served) == [0, 1, 2] and none == {}
    assert torch.equal(fused, reference)


@pytest.mark.parametrize(
    "family, kw, served",
    [
        ("mixtral", {}, True),
        ("mixtral", dict(sliding_window=64), False),
        ("olmoe", {}, False),
        ("qwen3_5_moe", {}, [False, True, False, True]),
    ],
    ids=["mixtral", "sliding-window", "olmoe", "qwen3.5"],
)
def test_the_native_layer_takes_only_the_layers_it_computes_exactly(tmp_path, family, kw, served):
    """No q/k norm (Mixtral) and Qwen3.5's gated attention (output gate, partial rotary,
    zero-centred norms) are served; a sliding window and a q/k norm over the whole projection
    (OLMoE) keep the module's own forward, and so does a linear-attention mixer (its own op:
    test_native_delta.py)."""
    from edge0.engine.backends.native_layers import servable
    from edge0.modeldir.loader import load_edge0_model
    from test_families import make_checkpoint

    make_checkpoint(tmp_path / "hf", family, **kw)
    convert(tmp_path / "hf", tmp_path / "e0", progress=False)
    _, model = load_edge0_model(tmp_path / "e0", torch.float32, experts="streaming")
    n = len(model.backbone.layers)
    expected = served if isinstance(served, list) else [served] * n
    assert [servable(layer) for layer in model.backbone.layers] == expected
    if served:  # and computes it bit-identically (no q/k norm here)
        fused, layers = decode_logits(tmp_path / "e0", "native")
        assert sorted(layers) == list(range(len(model.backbone.layers)))
        assert torch.equal(fused, decode_logits(tmp_path / "e0", "torch")[0])


NO_COMPILER = """
import logging, sys
from pathlib import Path
from edge0 import native
from edge0.engine import backends
from edge0.engine.options import EngineOptions
logging.basicConfig(level=logging.WARNING, format="%(message)s")
cache = Path(sys.argv[1])
try:
    backends.choose(EngineOptions(backend="native", cache_dir=cache))
    sys.exit("native did not refuse")
except native.NativeUnavailable as e:
    print("REFUSED", e)
assert backends.choose(EngineOptions(cache_dir=cache)).name == "torch"
assert not native.library_path(cache).exists()  # nothing half-built left to load
print("FELL BACK")
"""


def test_a_machine_without_a_compiler_is_told_and_falls_back(tmp_path):
    # a fresh process: this one may have the op registered already, and then uses it
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"))
    out = subprocess.run(
        [sys.executable, "-c", NO_COMPILER, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REFUSED could not compile the native decode kernels" in out.stdout
    assert "no-such-compiler" in out.stdout  # the reason is the compiler's failure
    assert "FELL BACK" in out.stdout and "pure-PyTorch" in out.stderr


def test_a_cache_folder_that_cannot_be_made_is_refused_not_raised(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(native.NativeUnavailable, match="cannot create"):
        native.build(blocker / "cache")


def test_backend_choice_is_checked():
    assert isinstance(backends.choose(EngineOptions(backend="torch")), TorchBackend)
    assert isinstance(backends.choose(EngineOptions()), NativeBackend)  # it has a compiler
    with pytest.raises(ValueError, match="backend must be one of auto, torch, native"):
        backends.choose(EngineOptions(backend="fast"))


@pytest.mark.slow
def test_the_op_compiles_from_source_into_an_empty_cache(tmp_path):
    """What `make`'s set-up does on a new machine (CI's cache may already hold a build),
    after a build that was killed while it compiled (its work folder keeps torch's lock file,
    which made every later build wait for ever while the folder was shared)."""
    path = native.library_path(tmp_path)
    path.parent.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.Popen(
        [sys.executable, "-m", "edge0.native", "--compile-into", str(path)], env=env
    )
    deadline = time.monotonic() + 120
    while not list(path.parent.glob("*/lock")) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    assert list(path.parent.glob("*/lock")) and not path.exists()  # killed while it built
    # set-up's build, in a process of its own so that a wait for the dead build's lock fails
    setup = [sys.executable, "-m", "edge0.native", "--cache-dir", str(tmp_path)]
    done = subprocess.run(setup, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "native decode kernels ready" in done.stdout, done.stdout
    assert native.build(tmp_path) == path
    assert path == native.library_path(tmp_path) and path.stat().st_size > 0
    # loaded in a fresh process (this one has the cached build's op registered already)
    check = (
        "import sys, torch; torch.ops.load_library(sys.argv[1]); "
        "print(torch.ops.edge0.swiglu_int4_gemv.default._schema)"
    )
    out = subprocess.run([sys.executable, "-c", check, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "swiglu_int4_gemv(Tensor x, Tensor[] w13" in out.stdout


def test_the_cli_names_the_reason_when_fused_cannot_be_built(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "edge0", "generate", "--prompt", "def", "--max-tokens", "2"]
        + ["--backend", "native"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2, out.stderr
    assert "edge0: error: could not compile the native decode kernels" in out.stderr
    assert "Traceback" not in out.stderr

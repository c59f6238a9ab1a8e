"""The C product for decode rows and long prefills (``_cpu_gemv.c``) against float64, ATen's
``_weight_int8pack_mm`` and vLLM's bf16 CPU linear, and the layers' choice between them
(``VLLM_OMNI_CPU_GEMV``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from cpu_helpers import widest_simd_by_cpuinfo

from omni_cpu_fastpath import cpu_gemv
from omni_cpu_fastpath.qwen3_tts import quant


def _operands(rows: int, k: int, n: int, x_dtype: torch.dtype, s_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(x_dtype)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, generator=g) / 50 + 1e-3).to(s_dtype)
    return x, q, s


def _bf16_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


def _reference_and_bound(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor | None, out: torch.dtype):
    """float64 product of the same (rounded) inputs, and the error float32 arithmetic may add: k
    rounded products, k - 1 additions and the scale's product, each within 2^-24 of the absolute
    sum (a bf16 x times an int8 or bf16 weight is exact), plus the output's own rounding."""
    xd, qd, sd = x.double(), q.double(), (1.0 if s is None else s.double())
    ref = (xd @ qd.T) * sd
    bound = (q.shape[1] + 2) * 2.0**-24 * (xd.abs() @ qd.abs().T) * sd
    if out is torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-8
    return ref, bound + 1e-30


ISAS = ("scalar", "avx2", "avx512", "avx512bf16")  # the extension's isa argument: their index


def test_the_kernel_is_built_and_checked_and_takes_the_widest_simd_of_this_cpu() -> None:
    # setup builds it; without it the int8 layers run ATen's kernel, and this test says so.
    assert cpu_gemv.wanted(), cpu_gemv.status()
    widest = widest_simd_by_cpuinfo()
    assert cpu_gemv.status() == f"C kernel ({widest}) for 1-8 rows", cpu_gemv.status()
    assert cpu_gemv._extension()[0].simd() == (ISAS.index(widest), widest)


@pytest.mark.parametrize(
    "cap, bad", [("avx512", False), ("avx2", False), ("scalar", False), ("avx-512", True)]
)
def test_the_isa_flag_caps_the_instruction_set_and_a_bad_value_is_named(cap: str, bad: bool) -> None:
    code = "from omni_cpu_fastpath import cpu_gemv\nprint(cpu_gemv.status())\n"
    env = {**os.environ, "VLLM_OMNI_CPU_GEMV_ISA": cap}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    if bad:
        assert out.returncode != 0
        assert "VLLM_OMNI_CPU_GEMV_ISA" in out.stderr and "avx2" in out.stderr, out.stderr[-2000:]
        return
    assert out.returncode == 0, out.stderr[-2000:]
    want = ISAS[min(ISAS.index(cap), ISAS.index(widest_simd_by_cpuinfo()))]
    assert out.stdout.strip().splitlines()[-1] == f"C kernel ({want}) for 1-8 rows"


def _ext_gemv(
    isa: int, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, threads: int
) -> torch.Tensor:
    rows, k = x.shape
    n = w.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32)
    cpu_gemv._extension()[0].gemv(
        x.data_ptr(), x.dtype is torch.bfloat16, rows, k, w.data_ptr(), int(w.dtype is torch.bfloat16),
        k, n, 0 if s is None else s.data_ptr(), s is not None and s.dtype is torch.bfloat16,
        y.data_ptr(), False, threads, isa,
    )  # fmt: skip
    return y


@pytest.mark.parametrize("isa", range(len(ISAS)))
def test_every_simd_of_this_cpu_equals_float64_and_keeps_each_row_alone(isa: int) -> None:
    """Each instruction set's path on its own (the layers take only the widest): within float32
    accumulation of float64, on k that leave tails of every width, and each row the same alone
    as in any batch at any thread count."""
    if isa > ISAS.index(widest_simd_by_cpuinfo()):
        with pytest.raises(ValueError, match="isa 0"):
            _ext_gemv(isa, *_operands(1, 64, 8, torch.float32, torch.float32), 1)
        return
    for k in (15, 48, 1037):
        x, q, s = _operands(8, k, 70, torch.bfloat16, torch.bfloat16, seed=isa * 10 + k)
        for w, scales in ((q, s), (_bf16_weight(70, k, seed=k), None)):
            alone = torch.cat([_ext_gemv(isa, x[i : i + 1], w, scales, 1) for i in range(8)])
            ref, bound = _reference_and_bound(x, w, scales, torch.float32)
            assert bool(((alone.double() - ref).abs() <= bound).all()), (ISAS[isa], k, w.dtype)
            for threads in (1, 2, 3):
                for rows in (2, 4, 5, 8):
                    got = _ext_gemv(isa, x[:rows], w, scales, threads)
                    assert torch.equal(got, alone[:rows]), (ISAS[isa], k, threads, rows)


@pytest.mark.parametrize("isa", range(len(ISAS)))
def test_group_scales_equal_float64_in_each_simd(isa: int) -> None:
    """bf16 scales per group of input weights ([N, K // group]): each group's dot product times
    its own scale, within float32 accumulation of float64 (two more roundings per group), every
    row the same alone as in a batch; groups that are not whole 64-weight blocks are refused.
    AVX512-BF16 with bf16 x dequantizes the weights to bf16 first: float64 of those weights, and
    bit for bit the kernel's product with them as bf16 weights."""
    if isa > ISAS.index(widest_simd_by_cpuinfo()):
        return
    ext = cpu_gemv._extension()[0]
    for k, group in ((64, 64), (384, 128), (1024, 64), (3072, 192)):
        g = torch.Generator().manual_seed(k + group)
        q = torch.randint(-127, 128, (70, k), generator=g, dtype=torch.int8)
        s = (torch.rand(70, k // group, generator=g) / 50 + 1e-3).to(torch.bfloat16)
        sd = s.double().repeat_interleave(group, dim=1)
        for x_dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(8, k, generator=g).to(x_dtype)

            def run(x: torch.Tensor, threads: int, q=q, s=s, k=k, group=group) -> torch.Tensor:
                y = torch.empty(x.shape[0], 70, dtype=torch.float32)
                ext.gemv(x.data_ptr(), x.dtype is torch.bfloat16, x.shape[0], k, q.data_ptr(), 0, k, 70,
                         s.data_ptr(), True, y.data_ptr(), False, threads, isa, group)  # fmt: skip
                return y

            alone = torch.cat([run(x[i : i + 1], 1) for i in range(8)])
            xd = x.double()
            if cpu_gemv.dequantizes_groups(isa, x_dtype):
                dequantized = cpu_gemv.dequantize_reference(q, s, torch.bfloat16)
                wd, terms = dequantized.double(), k + 2
                assert torch.equal(alone, _ext_gemv(isa, x, dequantized, None, 1))
            else:
                wd, terms = q.double() * sd, k + 2 * (k // group) + 2
            ref = xd @ wd.T
            bound = terms * 2.0**-24 * (xd.abs() @ wd.abs().T) + 1e-30
            assert bool(((alone.double() - ref).abs() <= bound).all()), (ISAS[isa], k, group, x_dtype)
            for rows, threads in ((3, 2), (8, 3)):
                assert torch.equal(run(x[:rows], threads), alone[:rows]), (ISAS[isa], k, rows)
            # Control: one scale for the whole row (the first group's) is visibly another product.
            if k > group:
                one_scale = (xd @ q.double().T) * s.double()[:, 0]
                assert not bool(((alone.double() - one_scale).abs() <= bound).all())
    y = torch.empty(1, 70)
    x = torch.randn(1, 256)
    q = torch.zeros(70, 256, dtype=torch.int8)
    for group, scales in ((96, torch.ones(70, 2)), (512, torch.ones(70, 1)), (-64, torch.ones(70, 4))):
        with pytest.raises(ValueError, match="group must be 0"):
            scales = scales.bfloat16()
            ext.gemv(x.data_ptr(), False, 1, 256, q.data_ptr(), 0, 256, 70, scales.data_ptr(), True,
                     y.data_ptr(), False, 1, isa, group)  # fmt: skip
    with pytest.raises(ValueError, match="bf16 group scales"):  # float32 scales are per row only
        ext.gemv(x.data_ptr(), False, 1, 256, q.data_ptr(), 0, 256, 70, torch.ones(70, 4).data_ptr(), False,
                 y.data_ptr(), False, 1, isa, 64)  # fmt: skip


def test_accepts_group_scales_only_in_whole_blocks() -> None:
    q = torch.zeros(70, 256, dtype=torch.int8)
    x = torch.ones(2, 256, dtype=torch.bfloat16)
    assert cpu_gemv.accepts(x, q, torch.ones(70, 4, dtype=torch.bfloat16))
    assert cpu_gemv.accepts(x, q, torch.ones(70, 2, dtype=torch.bfloat16))
    assert not cpu_gemv.accepts(x, q, torch.ones(70, 8, dtype=torch.bfloat16))  # groups of 32
    assert not cpu_gemv.accepts(x, q, torch.ones(70, 3, dtype=torch.bfloat16))  # 256 / 3
    assert not cpu_gemv.accepts(x, q, torch.ones(70, 4))  # float32 group scales
    assert not cpu_gemv.accepts(x, q, torch.ones(69, 4, dtype=torch.bfloat16))
    assert cpu_gemv.group_size(q, torch.ones(70, 4)) == 64 and cpu_gemv.group_size(q, torch.ones(70)) == 0


@pytest.mark.parametrize("isa", range(len(ISAS)))
def test_dequantize_equals_float64_rounded_once_in_each_simd(isa: int) -> None:
    """The prefill's dequantization: every int8 value times its group's bf16 scale, computed in
    float64 and rounded once (to bf16 by torch's conversion, nearest even, or to float32), bit for
    bit; the same as torch's own ``q.to(bfloat16) * scale``, with any thread count."""
    if isa > ISAS.index(widest_simd_by_cpuinfo()):
        return
    ext = cpu_gemv._extension()[0]
    for n, k, group in ((3, 64, 64), (70, 384, 128), (33, 1024, 64), (17, 3072, 192)):
        g = torch.Generator().manual_seed(n + k)
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        if k >= 256:
            q[0, :256] = torch.arange(-128, 128, dtype=torch.int8)  # every int8 value
        s = (torch.randn(n, k // group, generator=g) / 300).to(torch.bfloat16)  # signed, full mantissas
        exact = q.double() * s.double().repeat_interleave(group, dim=1)
        for dtype, threads in ((torch.bfloat16, 1), (torch.float32, 1), (torch.bfloat16, 3)):
            out = torch.empty(n, k, dtype=dtype)
            ext.dequantize(q.data_ptr(), n, k, s.data_ptr(), group, out.data_ptr(), dtype is torch.bfloat16,
                           threads, isa)  # fmt: skip
            bits = torch.int16 if dtype is torch.bfloat16 else torch.int32
            assert torch.equal(out.view(bits), exact.to(dtype).view(bits)), (ISAS[isa], k, dtype)
            torch_product = q.view(n, k // group, group).to(dtype) * s.to(dtype)[..., None]
            assert torch.equal(out, torch_product.view(n, k))
        # Control: truncating to bf16 instead of rounding is visibly another result.
        truncated = (exact.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        assert not torch.equal(truncated, exact.to(torch.bfloat16))
    out = torch.empty(70, 256, dtype=torch.bfloat16)
    q = torch.zeros(70, 256, dtype=torch.int8)
    s = torch.ones(70, 4, dtype=torch.bfloat16)
    for group in (0, 96, 512, -64):
        with pytest.raises(ValueError, match="group a positive multiple of 64 dividing k"):
            ext.dequantize(q.data_ptr(), 70, 256, s.data_ptr(), group, out.data_ptr(), True, 1, isa)


def test_dequantize_refuses_operands_by_name() -> None:
    q = torch.zeros(70, 256, dtype=torch.int8)
    s = torch.ones(70, 4, dtype=torch.bfloat16)
    assert cpu_gemv.dequantize(q, s).shape == (70, 256)
    for bad_q, bad_s, dtype in (
        (q, torch.ones(70, 8, dtype=torch.bfloat16), torch.bfloat16),  # groups of 32
        (q, torch.ones(70, 4), torch.bfloat16),  # float32 group scales
        (q, torch.ones(70, dtype=torch.bfloat16), torch.bfloat16),  # per-row scales
        (torch.zeros(256, 70, dtype=torch.int8).t(), s, torch.bfloat16),  # not contiguous
        (q.to(torch.bfloat16), s, torch.bfloat16),
        (q, s, torch.float16),
    ):
        with pytest.raises(ValueError, match="dequantize takes contiguous int8 weights"):
            cpu_gemv.dequantize(bad_q, bad_s, dtype)


@pytest.mark.parametrize("isa", range(len(ISAS)))
def test_every_int8_value_and_every_tail_width_is_exact_in_each_simd(isa: int) -> None:
    """All 256 int8 values (the bf16 path looks each up in a byte table by magnitude, -128 and 0
    are its edges) in every position of a 64-weight block, with bf16 and float32 activations
    (float32 ones take the AVX-512 path there), on k that leave every tail length mod 64."""
    if isa > ISAS.index(widest_simd_by_cpuinfo()):
        return
    values = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    for k in (64, 128, 1, 31, 63, 65, 96, 191):
        q = torch.stack([values.roll(j)[:k] for j in range(0, 256, 7)])
        for x_dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).to(x_dtype)
            got = _ext_gemv(isa, x, q, None, 2)
            ref, bound = _reference_and_bound(x, q, None, torch.float32)
            assert bool(((got.double() - ref).abs() <= bound).all()), (ISAS[isa], k, x_dtype)
    one_hot = torch.zeros(256, 256, dtype=torch.int8)  # each value alone: its product is exact
    one_hot[torch.arange(256), torch.arange(256)] = values
    got = _ext_gemv(isa, torch.ones(1, 256).to(torch.bfloat16), one_hot, None, 1)
    assert torch.equal(got[0], values.float()), ISAS[isa]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("k", [1, 7, 16, 200, 1037])
@pytest.mark.parametrize("x_dtype,s_dtype", [(torch.bfloat16,) * 2, (torch.float32,) * 2])
def test_gemv_equals_float64_within_float32_accumulation(rows, k, x_dtype, s_dtype) -> None:
    x, q, s = _operands(rows, k, 37, x_dtype, s_dtype, seed=rows * 1000 + k)
    w = _bf16_weight(37, k, seed=k)
    for weight, scales in ((q, s), (w, None), (w, s)):
        assert cpu_gemv.accepts(x, weight, scales)
        for out in (x_dtype, torch.float32):
            y = cpu_gemv.gemv(x, weight, scales, out_dtype=out)
            assert y.dtype == out and y.shape == (rows, 37)
            ref, bound = _reference_and_bound(x, weight, scales, out)
            err = (y.double() - ref).abs()
            assert bool((err <= bound).all()), (weight.dtype, err.max().item(), bound.min().item())


def test_gemv_matches_atens_int8pack_mm_on_bf16() -> None:
    """Both multiply the same bf16 activations by the same int8 rows; only the summation order
    and, for the output, one bf16 rounding may differ."""
    x, q, s = _operands(8, 1024, 512, torch.bfloat16, torch.bfloat16, seed=3)
    for rows in (1, 2, 8):
        ours = cpu_gemv.gemv(x[:rows], q, s)
        aten = torch.ops.aten._weight_int8pack_mm(x[:rows], q, s)
        ref, bound = _reference_and_bound(x[:rows], q, s, torch.bfloat16)
        assert bool(((ours.double() - ref).abs() <= bound).all())
        assert bool(((aten.double() - ref).abs() <= bound).all())  # the same bound holds for ATen


def test_each_row_is_the_same_alone_and_in_any_batch_and_thread_count() -> None:
    """A request's result must not depend on its batch neighbours or the thread count: every row
    is summed in the same order in groups of 1-4 rows, and each output channel by one thread."""
    x, q, s = _operands(8, 300, 70, torch.bfloat16, torch.bfloat16, seed=4)
    alone = torch.cat([cpu_gemv.gemv(x[i : i + 1], q, s) for i in range(8)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for rows in (2, 3, 5, 8):
                assert torch.equal(cpu_gemv.gemv(x[:rows], q, s), alone[:rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", range(len(ISAS)))
def test_a_long_prefill_sums_each_row_as_a_decode_row_alone(isa: int) -> None:
    """Many rows of int8 weights (a prompt's prefill; with AVX512-BF16 each block of weights is
    widened once for all of them): every row equals float64 within float32 accumulation and is
    bit for bit that row decoded alone, with per-row and group scales, a k with a tail, output
    channels that leave partial blocks, and any thread count."""
    if isa > ISAS.index(widest_simd_by_cpuinfo()):
        return
    ext = cpu_gemv._extension()[0]
    n = 37
    for k, group in ((200, 0), (1024, 0), (256, 64), (384, 128)):
        g = torch.Generator().manual_seed(k + group)
        x = torch.randn(100, k, generator=g).to(torch.bfloat16)
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        s = (torch.rand(n, k // group if group else 1, generator=g) / 50 + 1e-3).to(torch.bfloat16).squeeze(1)
        sd = s.double().repeat_interleave(group, dim=1) if group else s.double()[:, None]

        def run(rows: int, threads: int, x=x, q=q, s=s, k=k, group=group) -> torch.Tensor:
            y = torch.empty(rows, n, dtype=torch.float32)
            ext.gemv(x.data_ptr(), True, rows, k, q.data_ptr(), 0, k, n, s.data_ptr(), True, y.data_ptr(),
                     False, threads, isa, group)  # fmt: skip
            return y

        def one(i: int, x=x, q=q, s=s, k=k, group=group) -> torch.Tensor:
            y = torch.empty(1, n, dtype=torch.float32)
            ext.gemv(x[i].data_ptr(), True, 1, k, q.data_ptr(), 0, k, n, s.data_ptr(), True, y.data_ptr(),
                     False, 1, isa, group)  # fmt: skip
            return y

        alone = torch.cat([one(i) for i in range(100)])
        xd, wd, terms = x.double(), q.double() * sd, k + 2 * (k // group if group else 1) + 2
        if group and cpu_gemv.dequantizes_groups(isa, x.dtype):  # the weights rounded to bf16 first
            wd, terms = cpu_gemv.dequantize_reference(q, s, torch.bfloat16).double(), k + 2
        bound = terms * 2.0**-24 * (xd.abs() @ wd.abs().T) + 1e-30
        assert bool(((alone.double() - xd @ wd.T).abs() <= bound).all()), (ISAS[isa], k, group)
        for rows, threads in ((5, 1), (13, 2), (33, 3), (100, 2)):
            assert torch.equal(run(rows, threads), alone[:rows]), (ISAS[isa], k, group, rows, threads)


def test_a_strided_weight_view_is_read_in_place() -> None:
    # The stacked heads hand the kernel views; a column slice has a row stride above k.
    x, q, s = _operands(2, 96, 40, torch.bfloat16, torch.bfloat16, seed=5)
    wide = torch.randint(-127, 128, (40, 160), dtype=torch.int8)
    wide[:, :96] = q
    view = wide[:, :96]
    assert view.stride(0) == 160
    assert cpu_gemv.accepts(x, view, s)
    assert torch.equal(cpu_gemv.gemv(x, view, s), cpu_gemv.gemv(x, q, s))


@pytest.mark.parametrize(
    "why, x, q, s",
    [
        ("9 rows", torch.zeros(9, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)),
        ("fp16 x", torch.zeros(1, 8).half(), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)),
        ("int16 weight", torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.int16), torch.ones(4)),
        ("k mismatch", torch.zeros(1, 9), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)),
        ("scales shape", torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(5)),
        ("column stride", torch.zeros(1, 4), torch.zeros(8, 4, dtype=torch.int8).T, torch.ones(4)),
    ],
)
def test_operands_the_kernel_does_not_take_go_to_aten(why, x, q, s) -> None:
    assert not cpu_gemv.accepts(x, q, s), why


def test_bad_arguments_to_the_extension_raise_not_crash() -> None:
    ext = cpu_gemv._extension()[0]
    x, q, s = _operands(1, 8, 4, torch.float32, torch.float32)
    y = torch.empty(1, 4)
    args = [x.data_ptr(), False, 1, 8, q.data_ptr(), 0, 8, 4, s.data_ptr(), False, y.data_ptr(), False, 1, 0]
    ext.gemv(*args)  # these are valid
    for i, bad in ((2, 0), (2, -3), (3, 0), (5, 2), (5, -1), (6, 7), (7, 0), (12, 0), (13, -1), (13, 4)):
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(ValueError, match="rows, k and n must be positive"):
            ext.gemv(*wrong)


def test_prefetching_ahead_changes_no_bit_and_stays_inside_the_weights() -> None:
    """The prefetch distance only asks memory early: on every instruction set of this CPU, any
    distance (one line, one row, a block, one past the whole matrix, whose requests would fall
    outside it) gives the same bits as none, for int8 weights with per-row or group scales and for
    bf16 weights, within float32 accumulation of float64; a negative distance is refused."""
    ext = cpu_gemv._extension()[0]
    rows, k, n = 5, 256, 200
    x, q, s = _operands(rows, k, n, torch.bfloat16, torch.bfloat16, seed=8)
    groups = (torch.rand(n, k // 64) / 50 + 1e-3).to(torch.bfloat16)
    w16 = _bf16_weight(n, k, seed=8)
    for isa in range(ext.simd()[0] + 1):
        for w, kind, scales, group in ((q, 0, s, 0), (q, 0, groups, 64), (w16, 1, None, 0)):
            outs = []
            for prefetch in (0, 64, k * w.element_size(), 8192, n * k * w.element_size() + 4096):
                y = torch.empty(rows, n, dtype=torch.float32)
                ext.gemv(x.data_ptr(), True, rows, k, w.data_ptr(), kind, k, n,
                         0 if scales is None else scales.data_ptr(), True, y.data_ptr(), False, 2, isa,
                         group, 0, 0, 0, prefetch)  # fmt: skip
                outs.append(y)
            assert all(torch.equal(outs[0], y) for y in outs[1:]), (ISAS[isa], kind, group)
            if group and isa == 3:
                continue  # there each weight times its scale is rounded to bf16 first
            wd = w.double() * groups.double().repeat_interleave(64, 1) if group else w
            ref, bound = _reference_and_bound(x, wd, None if group else scales, torch.float32)
            assert bool(((outs[0].double() - ref).abs() <= bound).all()), (ISAS[isa], kind, group)
    with pytest.raises(ValueError, match="prefetch must be 0"):
        ext.gemv(x.data_ptr(), True, rows, k, q.data_ptr(), 0, k, n, s.data_ptr(), True,
                 torch.empty(rows, n).data_ptr(), False, 1, 0, 0, 0, 0, 0, -64)  # fmt: skip


def test_the_prefetch_flag_reaches_the_kernel_and_a_bad_value_is_named() -> None:
    code = "from omni_cpu_fastpath import cpu_gemv\nprint(cpu_gemv._prefetch())\n"
    unset = {k: v for k, v in os.environ.items() if k != "VLLM_OMNI_CPU_GEMV_PREFETCH"}
    for value, want in (("0", "0"), ("4096", "4096"), (None, "8192")):
        env = unset if value is None else {**unset, "VLLM_OMNI_CPU_GEMV_PREFETCH": value}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
        )
        assert out.returncode == 0 and out.stdout.split()[-1] == want, (value, out.stderr[-2000:])
    env = {**os.environ, "VLLM_OMNI_CPU_GEMV_PREFETCH": "-1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0 and "VLLM_OMNI_CPU_GEMV_PREFETCH" in out.stderr, out.stderr[-2000:]


def _linear(seed: int = 6) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 256, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(96, generator=g) * 0.1)
    return lin


def test_int8_linear_takes_the_kernel_for_few_rows_and_aten_otherwise(monkeypatch) -> None:
    lin = _linear()
    on = quant.Int8Linear.from_linear(lin)
    monkeypatch.setenv("VLLM_OMNI_CPU_GEMV", "0")
    off = quant.Int8Linear.from_linear(lin)
    assert on.gemv and not off.gemv
    assert cpu_gemv.status() == "torch's kernels (VLLM_OMNI_CPU_GEMV=0)"
    x = torch.randn(3, 256).to(torch.bfloat16)
    aten = torch.ops.aten._weight_int8pack_mm(x, off.qweight, off.scales) + off.bias.to(torch.bfloat16)
    assert torch.equal(off(x), aten)  # flag off: exactly ATen's product
    kernel = cpu_gemv.gemv(x, on.qweight, on.scales) + on.bias.to(torch.bfloat16)
    assert torch.equal(on(x), kernel)  # flag on: exactly the kernel's
    big = torch.randn(9, 256).to(torch.bfloat16)  # above 8 rows: ATen's, flag or not
    assert torch.equal(on(big), off(big))


def test_the_op_takes_any_row_count_in_blocks_and_a_compiled_linear_calls_it() -> None:
    """``gemv_op`` (what a compiled step calls): every row equals float64 within the bound and
    equals the eager kernel's row, beyond 8 rows too; an ``Int8Linear`` inside a
    compiled graph gives exactly its eager output, with the kernel in the graph, not ATen's mm."""
    x, q, s = _operands(19, 300, 70, torch.bfloat16, torch.bfloat16, seed=8)
    got = cpu_gemv.gemv_op(x, q, s)
    ref, bound = _reference_and_bound(x, q, s, torch.bfloat16)
    assert bool(((got.double() - ref).abs() <= bound).all())
    assert torch.equal(got, torch.cat([cpu_gemv.gemv(x[i : i + 1], q, s) for i in range(19)]))
    torch.library.opcheck(cpu_gemv.gemv_op, (x, q, s))
    torch.library.opcheck(cpu_gemv.gemv_op, (x[:3].float(), _bf16_weight(70, 300), None))

    # No bias: Inductor would add it before rounding to bf16, where eager rounds twice.
    lin = quant.Int8Linear(*quant.quantize_per_channel(_linear().weight))
    assert lin.gemv
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(lin, backend=backend, fullgraph=True, dynamic=False)
    for rows in (1, 5, 16):
        xb = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = torch.cat([cpu_gemv.gemv(xb[i : i + 1], lin.qweight, lin.scales) for i in range(rows)])
        assert torch.equal(compiled(xb), want), rows
    targets = {str(n.target) for g in backend.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("omni_cpu_fastpath.gemv" in t for t in targets), targets
    assert not any("_weight_int8pack_mm" in t for t in targets), targets


def test_int8_stacked_heads_take_the_kernel(monkeypatch) -> None:
    g = torch.Generator().manual_seed(7)
    table = torch.randn(15, 64, 128, generator=g) * 0.05
    on = quant.Int8StackedHeads(table)
    monkeypatch.setenv("VLLM_OMNI_CPU_GEMV", "0")
    off = quant.Int8StackedHeads(table)
    h = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    for step in (0, 14):
        want = cpu_gemv.gemv(h, on.qweight[step], on.scales[step])
        assert torch.equal(on(h, torch.tensor(step)), want)
        aten = torch.ops.aten._weight_int8pack_mm(h, off.qweight[step], off.scales[step])
        assert torch.equal(off(h, torch.tensor(step)), aten)
    torch.library.opcheck(quant.stacked_int8pack_mm, (h, on.qweight, on.scales, torch.tensor([2]), True))


def test_one_openmp_runtime_is_loaded() -> None:
    """The kernel links libgomp.so.1 by name: with torch loaded first, the loader hands it torch's
    own runtime, so the two share one thread pool instead of oversubscribing the cores."""
    code = (
        "import torch\n"
        "from omni_cpu_fastpath import cpu_gemv\n"
        "assert cpu_gemv.wanted()\n"
        "x = torch.randn(2, 64).bfloat16(); q = torch.ones(32, 64, dtype=torch.int8)\n"
        "cpu_gemv.gemv(x, q, torch.ones(32).bfloat16())\n"
        "paths = {line.split()[-1] for line in open('/proc/self/maps') if 'gomp' in line}\n"
        "print(sorted(paths))\n"
        "assert len(paths) == 1, paths\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_load_check_and_the_product_hold_under_a_bf16_default_dtype() -> None:
    """vLLM builds and loads a bf16 model with torch's default dtype set to bf16, where the
    kernel is first loaded and checked: no tensor here may take its dtype from that default."""
    ext = cpu_gemv._extension()[0]
    x, q, s = _operands(2, 100, 30, torch.bfloat16, torch.bfloat16, seed=8)
    want = cpu_gemv.gemv(x, q, s)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        assert cpu_gemv._self_check(ext) is None
        assert torch.equal(cpu_gemv.gemv(x, q, s), want)
        assert cpu_gemv.gemv(x.float(), q, s.float()).dtype == torch.float32
    finally:
        torch.set_default_dtype(prev)


def test_talker_int8_linear_takes_the_kernel_for_decode_rows() -> None:
    """Decode rows go through the kernel, which adds the outlier columns' float32 share before it
    rounds once (float64 bound); a longer call stays ATen's product plus a separate float32 one."""
    from omni_cpu_fastpath.qwen3_tts.quant.modules import float_columns_product, quantize_with_float_columns
    from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import int8_linear

    g = torch.Generator().manual_seed(9)
    weight = torch.randn(80, 192, generator=g) * 0.05
    weight[:, [5, 77]] *= 30  # the float columns carry a large share, as outlier channels do
    q, s, cols, fw = quantize_with_float_columns(weight, torch.tensor([5, 77]))
    s = s.to(torch.bfloat16)
    for rows in (1, 4, 8, 12):
        x = torch.randn(rows, 192, generator=g).to(torch.bfloat16)
        got = int8_linear(x, q, s, float_cols=cols, float_weight=fw, gemv=True)
        separate = cpu_gemv.gemv(x, q, s) if rows <= 8 else torch.ops.aten._weight_int8pack_mm(x, q, s)
        separate = separate + float_columns_product(x, cols, fw).to(torch.bfloat16)
        if rows > 8:
            assert torch.equal(got, separate), rows
            continue
        ref, bound = _reference_and_bound(x, q, s.float(), torch.float32)
        side = x.double()[:, cols] @ fw.double().T
        ref = ref + side
        bound = bound + 4 * 2.0**-24 * (x.double()[:, cols].abs() @ fw.double().abs().T) + ref.abs() * 2.0**-8
        assert bool(((got.double() - ref).abs() <= bound).all()), rows
        # One rounding, not three: never further from float64 than the separate sum, often closer.
        assert (got.double() - ref).abs().sum() < (separate.double() - ref).abs().sum(), rows


@pytest.mark.parametrize("group", [0, 64])
def test_float_columns_are_added_in_float32_for_each_row_alone(group: int) -> None:
    """The kernel's float columns (a layer's outlier input channels, float32 weights), in every
    instruction set this CPU runs: within float32 accumulation of a float64 product, and each row's
    result the same alone or among 13 rows."""
    ext = cpu_gemv._extension()[0]
    g = torch.Generator().manual_seed(12)
    n, k = 70, 256
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, k // group, generator=g) / 100 + 1e-3) if group else torch.rand(n, generator=g) / 100
    s = s.to(torch.bfloat16)
    cols = torch.tensor([3, 130, 255])
    fw = torch.randn(n, 3, generator=g)
    x = torch.randn(13, k, generator=g).to(torch.bfloat16)

    def kernel(x: torch.Tensor, isa: int) -> torch.Tensor:
        side_x, side_w = cpu_gemv._side_operands(x, cols, fw)
        y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        ext.gemv(x.data_ptr(), True, x.shape[0], k, q.data_ptr(), 0, k, n, s.data_ptr(), True, y.data_ptr(),
                 True, 2, isa, group, side_x.data_ptr(), side_w.data_ptr(), 3)  # fmt: skip
        return y

    for isa in range(ext.simd()[0] + 1):
        assert cpu_gemv._mismatch(ext, x, q, s, group, isa, (cols, fw)) is None, ISAS[isa]
        many = kernel(x, isa)
        for r in range(13):
            assert torch.equal(kernel(x[r : r + 1], isa), many[r : r + 1]), (ISAS[isa], r)
    assert torch.equal(cpu_gemv.gemv(x, q, s, float_cols=cols, float_weight=fw), kernel(x, cpu_gemv._isa()))
    with pytest.raises(ValueError, match=r"float_weight must be \[N, c\] = \[70, 3\]"):
        cpu_gemv.gemv(x, q, s, float_cols=cols, float_weight=fw[:, :2])


def test_bf16_weights_match_vllms_cpu_linear_within_rounding() -> None:
    """vLLM's CPU linear of bf16 weights (oneDNN here, emulated without AVX512-BF16) multiplies the
    same bf16 values and accumulates in fp32: both within the same bound of float64."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = nn.Module()
    layer.weight = nn.Parameter(_bf16_weight(300, 512, seed=10), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    for rows in (1, 3, 8):
        ours = cpu_gemv.gemv(x[:rows], layer.weight)
        with torch.inference_mode():
            vllm = layer.cpu_linear(x[:rows], layer.weight, None)
        ref, bound = _reference_and_bound(x[:rows], layer.weight, None, torch.bfloat16)
        assert bool(((ours.double() - ref).abs() <= bound).all()), rows
        assert bool(((vllm.double() - ref).abs() <= bound).all()), rows

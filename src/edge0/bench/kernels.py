"""`edge0 bench --kernels`: the CPU matmul choices the executors rest on, timed on this machine.

Rows: the int4 kernel at several token counts against dequantize + dense matmul (fp32 and
bf16), the one-off cost of packing a projection, and of dequantizing one. Medians of many
runs; each op is warmed first. The int4 rows use the arrangement this machine's kernel wants
(`int4_layout.host_layout`), and the report names it with torch's CPU capability.
"""

from __future__ import annotations

import time

import torch

from edge0.formats import int4_layout, quant


def median_us(fn, runs: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def measure(shapes=((512, 2048), (2048, 512)), tokens=(1, 4, 16, 48, 64, 128, 512)) -> list[dict]:
    rows = []
    host = int4_layout.host_layout()
    other = next(lay for lay in int4_layout.LAYOUTS.values() if lay != host)
    for n, k in shapes:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = (torch.rand(n, k // quant.GROUP) * 0.01).bfloat16()
        bias = (torch.randn(n, k // quant.GROUP) * 0.01).bfloat16()
        packed = host.pack(q)
        pairs = quant.pairs_from(scale, bias)
        quant.to_kernel_pairs(pairs)
        w32 = host.dequantize(packed, pairs, n, k)
        wbf = w32.bfloat16()
        rows.append(
            {
                "op": "pack (convert time)",
                "shape": f"[{n},{k}]",
                "us": median_us(
                    lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1), 10
                ),
            }
        )
        rows.append(
            {
                "op": "dequantize -> fp32",
                "shape": f"[{n},{k}]",
                "us": median_us(lambda: host.dequantize(packed, pairs, n, k), 10),
            }
        )
        for m in tokens:
            x = torch.randn(m, k)
            xb = x.bfloat16()
            rows.append(
                {
                    "op": "int4 kernel (bf16 act)",
                    "shape": f"[{m},{k}]x[{n},{k}]",
                    "tokens": m,
                    "us": median_us(lambda: quant.int4_linear(xb, packed, pairs)),
                }
            )
            rows.append(
                {
                    "op": "fp32 linear (predequantized)",
                    "shape": f"[{m},{k}]x[{n},{k}]",
                    "tokens": m,
                    "us": median_us(lambda: torch.nn.functional.linear(x, w32)),
                }
            )
            rows.append(
                {
                    "op": "bf16 linear (predequantized)",
                    "shape": f"[{m},{k}]x[{n},{k}]",
                    "tokens": m,
                    "us": median_us(lambda: torch.nn.functional.linear(xb, wbf)),
                }
            )
        x1 = torch.randn(1, k)
        scale32 = torch.rand(k // quant.GROUP, n, 2)
        rows.append(
            {
                "op": "int4 kernel (fp32 act)",
                "shape": f"[1,{k}]x[{n},{k}]",
                "tokens": 1,
                "us": median_us(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        x1, packed, quant.GROUP, scale32
                    )
                ),
            }
        )
        rows.append(
            {
                "op": f"repack {other.name} -> {host.name} (on-read relayout)",
                "shape": f"[{n},{k}]",
                "us": median_us(lambda: int4_layout.relayout(packed, n, k, other, host), 10),
            }
        )
    return rows


def report(rows: list[dict]) -> str:
    host = int4_layout.host_layout().name
    cap = torch.backends.cpu.get_cpu_capability()
    lines = [
        f"torch {torch.__version__}, CPU capability {cap}, int4 layout {host}, "
        f"{torch.get_num_threads()} threads",
        "",
        "| op | shape | µs (median) |",
        "|---|---|---|",
    ]
    lines += [f"| {r['op']} | {r['shape']} | {r['us']:.0f} |" for r in rows]
    return "\n".join(lines)

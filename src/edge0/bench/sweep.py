"""`edge0 bench MODEL_DIR --read-bandwidth 0.2G,0.5G,1G,2G,none --top-k 2,4,8`: the
prerouter against on-demand as the disk gets slower (the paper's Figure 3, on Linux).

For each K and each read rate, the A/B of bench/ab.py runs with both capped arms inside a
kernel read throttle on the disk that holds the model (util/throttle.py; "none": the disk as
it is). D is each arm's bytes per step over the disk's read rate measured inside the same
throttle; C is the compute step: the resident arm's where it runs, else the unthrottled
prerouter arm's step less the time it blocked on reads. `plot` draws tok/s against the read
rate with the bound 1 / max(C, D) of the prerouter arm's bytes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from edge0.bench.ab import BenchConfig, bound, report, run_bench

GB = 1e9
DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rates(text: str) -> list[int | None]:
    """'0.2G,500M,none' -> [200000000, 500000000, None]: bytes/s in decimal units (a disk's
    rate is quoted in GB/s; an optional 'B' or 'B/s' after the unit), 'none' for the disk
    unthrottled."""
    rates: list[int | None] = []
    for part in text.split(","):
        if part.strip().lower() == "none":
            rates.append(None)
            continue
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(b(/s)?)?\s*", part.lower())
        if not m or float(m.group(1)) <= 0:
            raise ValueError(f"--read-bandwidth: {part!r} is not a rate like 0.5G or none")
        rates.append(int(float(m.group(1)) * DECIMAL[m.group(2)]))
    return rates


def run_sweep(model_dir: Path, cfg: BenchConfig, ks: list[int], rates: list[int | None]) -> dict:
    """Every (K, rate) point's A/B; the resident arm (if asked for) once per K, unthrottled."""
    points = []
    for k in ks:
        c_ms = None
        for i, rate in enumerate(sorted(rates, key=lambda r: float("inf") if r is None else -r)):
            arms = tuple(a for a in cfg.arms if a != "resident" or i == 0)
            point = run_bench(
                model_dir, dataclasses.replace(cfg, top_k=k, arms=arms, read_bandwidth=rate)
            )
            print(report(point), flush=True)
            c_ms = point["C_ms"] if point["C_ms"] is not None else c_ms
            points.append(point)
        if c_ms is None:  # no resident arm: the fastest prerouter run less its waits
            free = [p for p in points if p["top_k"] == k and p["read_bandwidth"] is None]
            pre = (free or [p for p in points if p["top_k"] == k])[0]["arms"]["prerouter"]
            c_ms = pre["step_ms"] - pre["blocked_ms_per_step"]
        for p in points:
            if p["top_k"] == k:
                p["C_ms"] = c_ms
                bound(p["arms"], c_ms)
    return {"model": str(model_dir), "memory_cap_bytes": cfg.memory_cap, "points": points}


def sweep_report(s: dict) -> str:
    lines = [
        "| K | read rate | disk GB/s | C ms | arm | tok/s | step ms | D ms | step/max(C,D) | "
        "blocked ms | dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in s["points"]:
        rate = "none" if p["read_bandwidth"] is None else f"{p['read_bandwidth'] / GB:.2f} GB/s"
        for arm, a in p["arms"].items():
            lines.append(
                f"| {p['top_k']} | {rate} | {p['disk_bandwidth_bytes_per_s'] / GB:.2f} | "
                f"{p['C_ms']:.1f} | {arm} | {a['decode_tok_s']['median']:.2f} | "
                f"{a['step_ms']:.1f} | {a['D_ms']:.1f} | {a['step_over_bound']:.2f} | "
                f"{a['blocked_ms_per_step']:.1f} | {a['dropped']} |"
            )
        if p["prerouter_over_ondemand"]:
            lines.append(f"| {p['top_k']} | {rate} | | | prerouter / on-demand | "
                         f"{p['prerouter_over_ondemand']:.2f}x | | | | | |")  # fmt: skip
    return "\n".join(lines)


def series(s: dict) -> dict[int, dict[str, list]]:
    """Per K: the throttled read rates (GB/s, ascending) and each arm's tok/s at them, the
    unthrottled runs apart (`free_gb_s`, `free_<arm>`: the disk's own rate), and the bound
    1 / max(C, D) on a grid of rates for the prerouter arm's median bytes per step."""
    out: dict[int, dict[str, list]] = {}
    for k in sorted({p["top_k"] for p in s["points"]}):
        pts = [p for p in s["points"] if p["top_k"] == k]
        throttled = sorted(
            (p for p in pts if p["read_bandwidth"] is not None),
            key=lambda p: p["disk_bandwidth_bytes_per_s"],
        )
        free = [p for p in pts if p["read_bandwidth"] is None]
        d: dict[str, list] = {
            "gb_s": [p["disk_bandwidth_bytes_per_s"] / GB for p in throttled],
            "free_gb_s": [p["disk_bandwidth_bytes_per_s"] / GB for p in free],
        }
        for arm in ("prerouter", "ondemand"):
            for key, group in ((arm, throttled), (f"free_{arm}", free)):
                d[key] = [
                    p["arms"][arm]["decode_tok_s"]["median"] if arm in p["arms"] else None
                    for p in group
                ]
        pre = [p["arms"]["prerouter"] for p in pts if "prerouter" in p["arms"]]
        rates = d["gb_s"] + d["free_gb_s"]
        if pre and rates:
            step_bytes = sorted(a["bytes_per_step"] for a in pre)[len(pre) // 2]
            c_ms = pts[0]["C_ms"]
            lo, hi = min(rates) / 1.5, max(rates) * 1.5
            grid = [lo * (hi / lo) ** (i / 63) for i in range(64)]
            d["bound_gb_s"] = grid
            d["bound_tok_s"] = [1e3 / max(c_ms, 1e3 * step_bytes / (g * GB)) for g in grid]
        out[k] = d
    return out


def plot(s: dict, path: Path, title: str = "") -> Path:
    """One panel per K: tok/s of both arms against the throttled read rate (log axis), the
    unthrottled runs as open markers at the disk's own rate, and the prerouter's bound
    1 / max(C, D); needs matplotlib (`pip install 'edge0[plot]'`)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, NullLocator

    data = series(s)
    fig = Figure(figsize=(4.2 * len(data), 4.2))
    axes = fig.subplots(1, len(data), squeeze=False)[0]
    for ax, (k, d) in zip(axes, data.items(), strict=True):
        for arm, marker in (("prerouter", "o"), ("ondemand", "s")):
            ys = [float("nan") if v is None else v for v in d[arm]]
            (line,) = ax.plot(d["gb_s"], ys, marker=marker, label=arm)
            free = [float("nan") if v is None else v for v in d[f"free_{arm}"]]
            ax.plot(d["free_gb_s"], free, marker=marker, ls="none", mfc="none",
                    color=line.get_color(), ms=9, label=f"{arm}, unthrottled")  # fmt: skip
        if "bound_gb_s" in d:
            ax.plot(d["bound_gb_s"], d["bound_tok_s"], "k--", lw=1, label="1 / max(C, D)")
        ax.set(xscale="log", xlabel="read bandwidth (GB/s)", title=f"K={k}")
        ticks = sorted(set(round(g, 2) for g in d["gb_s"] + d["free_gb_s"]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(ticks, [f"{t:.2g}" for t in ticks], fontsize=8)
        ax.set_ylabel("decode tok/s (median)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path

"""The PNG of `edge0 bench --peer`: decode tok/s, peak memory and reads against the memory cap.

`series` turns a summary into plain per-engine lists (tested without matplotlib); `plot`
draws them. The x axis is categorical, tightest cap on the left and "none" on the right,
because "none" has no position on a byte axis.
"""

from __future__ import annotations

from pathlib import Path

GIB = 2**30


def cap_labels(summary: dict) -> list[str]:
    """Cap labels ordered tightest first, uncapped last, e.g. ['1/3\\n0.87 GiB', ..., 'none']."""
    caps = sorted(summary["caps"], key=lambda c: float("inf") if c["bytes"] is None else c["bytes"])
    return [c["label"] for c in caps]


def series(summary: dict) -> dict[str, dict[str, list[float | None]]]:
    """{engine: {'tok_s', 'anon_gib', 'file_gib', 'read_mib', 'killed': [one per cap]}},
    caps in cap_labels order; None where an engine has no run at that cap or was OOM-killed
    (or crashed) there, and then 'killed' says which ("OOM-killed", "crashed: SIGSEGV")."""
    labels = cap_labels(summary)
    out: dict[str, dict[str, list[float | None]]] = {}
    for row in summary["rows"]:
        s = out.setdefault(
            row["engine"],
            {k: [None] * len(labels) for k in ("tok_s", "anon_gib", "file_gib", "read_mib")},
        )
        s.setdefault("killed", [False] * len(labels))
        i = labels.index(row["cap"])
        if row["decode_tok_s"] is None:  # OOM-killed (or crashed) in every round: no point
            s["killed"][i] = ", ".join(row.get("crashed") or ["OOM-killed"])
            continue
        s["tok_s"][i] = row["decode_tok_s"]
        s["anon_gib"][i] = row["peak_anon_bytes"] / GIB
        s["file_gib"][i] = row["peak_file_bytes"] / GIB
        s["read_mib"][i] = row["read_bytes_per_token"] / 2**20
    return out


def plot(summary: dict, path: Path) -> Path:
    """Write the four-panel PNG to path; needs matplotlib (the peer extra)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display

    labels = cap_labels(summary)
    by_label = {c["label"]: c["bytes"] for c in summary["caps"]}
    ticks = [lb if by_label[lb] is None else f"{lb}\n{by_label[lb] / GIB:.2f} GiB" for lb in labels]
    x = list(range(len(labels)))
    data = series(summary)
    fig = Figure(figsize=(12, 8.5))
    (ax1, ax2), (ax3, ax4) = fig.subplots(2, 2)
    for engine, s in data.items():
        s = {k: [float("nan") if v is None else v for v in vs] for k, vs in s.items()}
        (line,) = ax1.plot(x, s["tok_s"], marker="o", label=engine)
        for i, k in ((i, k) for i, k in enumerate(s["killed"]) if k):
            ax1.annotate(
                f"{engine}\n{k}", (i, 0.5), xycoords=("data", "axes fraction"),
                color=line.get_color(), fontsize=8, ha="center",
            )  # fmt: skip
        for ax, key in ((ax2, "read_mib"), (ax3, "anon_gib"), (ax4, "file_gib")):
            ax.plot(x, s[key], marker="o", color=line.get_color(), label=engine)
    ax1.set(ylabel="tok/s (median)", title="decode speed", yscale="log")
    ax2.set(ylabel="MiB per token", title="read from disk while decoding", yscale="symlog")
    ax3.set(ylabel="GiB", title="peak anonymous memory (RssAnon)")
    ax4.set(ylabel="GiB", title="peak file-backed memory (RssFile)")
    ax3.set_ylim(bottom=0)
    ax4.set_ylim(bottom=0)
    m = summary.get("models", {}).get("config", {})
    shape = (
        f"{m.get('num_hidden_layers')} layers, d={m.get('hidden_size')}, "
        f"{m.get('num_experts')}x{m.get('moe_intermediate_size')} experts, "
        f"top-{m.get('num_experts_per_tok')}"
    )
    cpu = summary.get("machine", {}).get("cpu", "")
    for ax in (ax1, ax2, ax3, ax4):
        ax.set_xticks(x, ticks)
        ax.set_xlabel("cgroup memory cap")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"edge0 vs llama.cpp (Q4_0, mmap), random Qwen3-MoE: {shape}; {cpu}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path

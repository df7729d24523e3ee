"""PNG plots of a result JSON (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    conc = sorted(int(c) for c in levels)
    targets = result["targets_measured"]
    colors = {"direct": "tab:blue", "gateway": "tab:orange"}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=80)
    panels = [
        ("req_s", "requests/s", axes[0][0]),
        ("out_tok_s", "output tokens/s", axes[0][1]),
        ("latency_p50_ms", "latency ms (p50 solid, p99 dashed)", axes[1][0]),
        ("ttft_p50_ms", "TTFT ms (p50 solid, p99 dashed)", axes[1][1]),
    ]
    for key, title, ax in panels:
        for target in targets:
            ys = [levels[str(c)][target].get(key) for c in conc]
            ax.plot(conc, ys, marker="o", color=colors.get(target), label=target)
            if key.endswith("_p50_ms"):
                ys99 = [levels[str(c)][target].get(key.replace("p50", "p99")) for c in conc]
                ax.plot(conc, ys99, marker=".", linestyle="--", color=colors.get(target), alpha=0.6)
        if "vs" in levels[str(conc[0])]:
            for c in conc:
                vs = levels[str(c)]["vs"][key]
                text = f"x{vs['ratio']:.2f}" if vs.get("ratio") is not None else ""
                if key.endswith("_ms") and vs.get("added_ms") is not None:
                    text = f"{vs['added_ms']:+.1f}ms"
                y = levels[str(c)].get("gateway", {}).get(key)
                if y is not None and text:
                    ax.annotate(text, (c, y), textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.set_xlabel("concurrency")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    w = result["workload"]
    fig.suptitle(
        f"{result['title']}  ({'stream' if w['stream'] else 'plain'}, prompt~{w['prompt_tokens']} tok, "
        f"{w['output_tokens']} out tok, {result['machine']['cpus']} CPUs)",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out

"""`kvfabric bench trace --plot FILE.png`: prefix hit ratio vs capacity per policy (one tier; LRU and Belady
drawn bold), and modelled mean TTFT vs capacity per two-tier set-up, one column per trace."""
from __future__ import annotations

from kvfabric.bench.common import save_figure, subplots

BASELINE_STYLE = {"lru": dict(color="black", linewidth=2.5),
                  "belady": dict(color="black", linewidth=2.5, linestyle="--")}


def plot_rows(rows: list[dict], path: str) -> None:
    traces = list(dict.fromkeys(row["trace"] for row in rows))
    panels = [(1, "prefix_hit_ratio", "prefix hit ratio (one tier)"),
              (2, "ttft_mean_s", "modelled mean TTFT, s (two tiers)")]
    panels = [p for p in panels if any(row["tiers"] == p[0] for row in rows)]
    fig, axes = subplots(len(panels), len(traces), figsize=(6 * len(traces), 4.2 * len(panels)), squeeze=False)
    for col, trace in enumerate(traces):
        for r, (tiers, field, title) in enumerate(panels):
            ax = axes[r][col]
            mine = [row for row in rows
                    if row["trace"] == trace and row["tiers"] == tiers and row["policy"] != "default"]
            for policy in dict.fromkeys(row["policy"] for row in mine):
                points = sorted((row["capacity_frac"], row[field]) for row in mine if row["policy"] == policy)
                style = BASELINE_STYLE.get(policy, dict(linestyle=":" if policy.startswith("oracle") else "-"))
                ax.plot([100 * x for x, _ in points], [y for _, y in points], marker="o", label=policy, **style)
            ax.set_xscale("log")
            ticks = sorted({100 * row["capacity_frac"] for row in mine})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("fast tier capacity, % of distinct blocks")
            ax.set_title(f"{trace}: {title}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save_figure(fig, path, 110)

"""Figures for ``frenzy simulate --compare ... --plot out.png``: the JCT CDF per policy and the
queue length over time. matplotlib is imported here only (Agg backend, no display)."""
from __future__ import annotations

from pathlib import Path


def plot_comparison(results, out: str | Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_q) = plt.subplots(1, 2, figsize=(13, 4.8))
    for r in results:
        xs = sorted(j / 3600.0 for j in r.jcts)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax_cdf.step(xs, ys, where="post", label=f"{r.policy} (avg {r.avg_jct_s / 3600:.2f} h)")
        if r.queue_series:
            ts = [t / 3600.0 for t, _ in r.queue_series]
            qs = [q for _, q in r.queue_series]
            ax_q.step(ts, qs, where="post", label=r.policy, linewidth=1.0)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("job completion time (h, log scale)")
    ax_cdf.set_ylabel("fraction of jobs")
    ax_cdf.set_title("JCT CDF")
    ax_cdf.grid(True, alpha=0.3)
    if ax_cdf.get_legend_handles_labels()[0]:      # no policy finished a job: no curve to name
        ax_cdf.legend(fontsize=8, loc="lower right")
    else:
        ax_cdf.text(0.5, 0.5, "no job completed", ha="center", va="center", transform=ax_cdf.transAxes)
    ax_q.set_xlabel("simulated time (h)")
    ax_q.set_ylabel("jobs waiting")
    ax_q.set_title("Queue length")
    ax_q.grid(True, alpha=0.3)
    if ax_q.get_legend_handles_labels()[0]:
        ax_q.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out

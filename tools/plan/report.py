"""A plan as a markdown table and Figure-4-style plots (docs/plan.md, "Output")."""

from __future__ import annotations

from pathlib import Path


def _ci(iv: dict) -> str:
    if iv.get("mean") is None:
        return "–"
    ci = iv.get("ci95")
    return f"{iv['mean']:.2f}" + (f" ({ci[0]:.2f}–{ci[1]:.2f})" if ci else "")


def markdown(result: dict) -> str:
    """The configurations ranked by sustainable QPS/GPU, then the verdict."""
    c = result["config"]
    lines = [f"Workload {c['workload']}" + (f" ({c['trace']})" if c["trace"] else "")
             + f", preset `{c['preset']}`, TTFT p90 SLO {c['slo_ttft_p90_s']} s"
             + (f", TPOT SLO {c['slo_tpot_s']} s" if c.get("slo_tpot_s") else "")
             + f", {c['seeds']} seed(s), ramp {c['ramp_s']} s + settle {c['settle_s']} s + "
             f"steady {c['steady_s']} s (simulated).", "",
             "| configuration | policy | GPUs | sustainable QPS/GPU (95 % CI) | "
             "target QPS/GPU | TTFT p90 s there |", "|---|---|---|---|---|---|"]
    ranked = sorted(result["topologies"].items(),
                    key=lambda kv: -(kv[1]["sustainable_qps_per_gpu"]["mean"] or 0))
    for _label, t in ranked:
        p90 = [r["at_sustainable"]["ttft_p90_s"] for r in t["seeds"]
               if r.get("at_sustainable") and r["at_sustainable"].get("ttft_p90_s") is not None]
        lines.append(f"| {t['topology']} | {t['policy']} | {t['gpus']} | "
                     f"{_ci(t['sustainable_qps_per_gpu'])} | "
                     f"{_ci(t['sustainable_target_qps_per_gpu'])} | "
                     f"{(sum(p90) / len(p90)) if p90 else float('nan'):.2f} |")
    lines += ["", f"Analytic bound: {result['analytic_bound_qps_per_gpu']:.2f} QPS/GPU."]
    for key in ("best_cpd_over_best_pd_kv", "best_cpd_over_best_pd_rr", "cpd_over_pd_rr",
                "cpd_over_pd_kv", "cpd_over_pd_kv_2d", "bound_fraction"):
        if key in result:
            lines.append(f"`{key}` {_ci(result[key])}")
    t = result["traffic"]
    lines += ["", f"Traffic: {t['requests']} requests, mean prompt "
              f"{t['mean_prompt_tokens']:.0f} tokens, cold share {t['cold_share']:.1%}, "
              f"mean reuse share {t['reuse_share_mean']:.1%}, load ÷ recompute "
              f"{t['load_over_recompute']}.", "", f"**Verdict.** {result['verdict_text']}", ""]
    return "\n".join(lines)


def plot(result: dict, out_dir: Path) -> list[str]:
    """``plan.png``: sustainable QPS/GPU per configuration with its interval and the
    analytic bound; TTFT p90 and achieved QPS/GPU against the target of every probe of
    the first seed. Empty without matplotlib (the ``bench`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    tops = result["topologies"]
    labels = list(tops)
    means = [tops[k]["sustainable_qps_per_gpu"]["mean"] or 0 for k in labels]
    errs = [[m - (tops[k]["sustainable_qps_per_gpu"]["ci95"] or [m, m])[0] for k, m in
             zip(labels, means, strict=True)],
            [(tops[k]["sustainable_qps_per_gpu"]["ci95"] or [m, m])[1] - m for k, m in
             zip(labels, means, strict=True)]]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    colors = {"cpd": "tab:green", "pd-kv": "tab:blue", "pd-rr": "tab:grey"}
    ax.bar(range(len(labels)), means, yerr=errs, capsize=4,
           color=[colors.get(tops[k]["policy"], "tab:orange") for k in labels])
    ax.axhline(result["analytic_bound_qps_per_gpu"], color="black", ls=":", lw=1,
               label="analytic bound")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize="small")
    ax.set_ylabel("sustainable QPS/GPU (95 % CI)")
    ax.legend()
    for key, ax, title in (("ttft_p90_s", axes[1], "TTFT p90 (s)"),
                           ("achieved_qps_per_gpu", axes[2], "achieved QPS/GPU")):
        for label in labels:
            pts = tops[label]["seeds"][0]["points"] if tops[label]["seeds"] else []
            xs = [p["target_qps_per_gpu"] for p in pts]
            ys = [p[key] if p[key] is not None else float("nan") for p in pts]
            ax.plot(xs, ys, marker="o", label=label)
        if key == "ttft_p90_s":
            ax.axhline(result["config"]["slo_ttft_p90_s"], color="grey", ls="--", lw=0.8)
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("target QPS/GPU")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize="x-small")
    c = result["config"]
    fig.suptitle(f"cpd plan: {c['workload']}, {c['preset']}")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "plan.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]

"""Plot throughput and p99 TTFT / TPOT against the swept concurrency or request rate (needs matplotlib)."""

from __future__ import annotations

from edgeserve.bench.report import BenchReport
from edgeserve.errors import EdgeserveError

MISSING = "--plot needs matplotlib; install it with: pip install 'edgeserve[plot]'"


def require_matplotlib() -> None:
    """Raise a one-line EdgeserveError when matplotlib is not installed (checked before any request is sent)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise EdgeserveError(MISSING) from None


def plot_report(report: BenchReport, path: str) -> None:
    """Two panels into `path` (PNG): output tokens/s, and p99 TTFT and TPOT (ms), against the swept level."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report.levels
    by_rate = levels[0].level.concurrency is None
    x = [lv.level.rate if by_rate else lv.level.concurrency for lv in levels]
    xlabel = "request rate (req/s)" if by_rate else "concurrent requests"
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(x, [lv.summary.output_tokens_per_s for lv in levels], "o-", label="output tokens/s")
    a.plot(x, [lv.summary.total_tokens_per_s for lv in levels], "s--", label="total tokens/s")
    a.set_xlabel(xlabel)
    a.set_ylabel("tokens/s")
    a.set_title("throughput")
    a.legend()
    b.plot(x, [lv.summary.ttft_ms.p99 for lv in levels], "o-", label="p99 TTFT")
    b.plot(x, [lv.summary.tpot_ms.p99 for lv in levels], "s-", label="p99 TPOT")
    b.set_xlabel(xlabel)
    b.set_ylabel("ms")
    b.set_yscale("log")
    b.set_title("latency")
    b.legend()
    fig.suptitle(f"{report.server_kind} {report.model or ''}: {report.workload}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

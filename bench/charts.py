"""PNG charts of a benchmark run: throughput per scenario, latency, throughput at scale, and the soak.

The figures are drawn on matplotlib's Agg canvas without pyplot: files only, no display, no global state.
"""
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import StrMethodFormatter

from bench.cross_node import SCALE_FLAT_WITHIN
from bench.results import Measurement, ScenarioResult

MEASURED, BASELINE = "tab:blue", "tab:gray"
BAR_HEIGHT = 0.38
THOUSANDS = "{x:,.0f}"


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=110)
    return path


def _bar(axes, position: float, measurement: Measurement, color: str) -> None:
    low, high = min(measurement.values), max(measurement.values)
    axes.barh(position, measurement.median, height=BAR_HEIGHT, color=color,
              xerr=[[measurement.median - low], [high - measurement.median]], capsize=3)
    axes.annotate(f" {measurement.median:,.0f} {measurement.unit} · {measurement.label}", (high, position),
                  va="center", fontsize=8)


def _throughput(results: list[ScenarioResult], path: Path) -> Path | None:
    rates = [result for result in results if result.measured and result.measured.unit.endswith("/s")]
    if not rates:
        return None
    figure = Figure(figsize=(11, 0.8 * len(rates) + 1.6), layout="constrained")
    axes = figure.subplots()
    for row, result in enumerate(rates):
        if result.baseline:
            _bar(axes, row - BAR_HEIGHT / 2, result.measured, MEASURED)
            _bar(axes, row + BAR_HEIGHT / 2, result.baseline, BASELINE)
        else:
            _bar(axes, row, result.measured, MEASURED)
    axes.set_yticks(range(len(rates)), [result.scenario for result in rates])
    axes.invert_yaxis()
    axes.set_xlim(0, 1.9 * max(max(result.measured.values + (result.baseline.values if result.baseline else []))
                               for result in rates))
    axes.xaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
    axes.set_xlabel("per second (bar: median; whiskers: min–max of the repetitions)")
    figure.legend(handles=[Patch(color=MEASURED, label="measured"), Patch(color=BASELINE, label="baseline in the same run")],
                  loc="outside lower center", ncols=2, fontsize=8)
    axes.set_title("Throughput per scenario")
    return _save(figure, path)


def _latency(results: list[ScenarioResult], path: Path) -> Path | None:
    measured = [result for result in results if result.series.get("latencies_ms")]
    if not measured:
        return None
    figure = Figure(figsize=(9, 4 * len(measured)), layout="constrained")
    for axes, result in zip(figure.subplots(len(measured), 1, squeeze=False)[:, 0], measured):
        latencies = sorted(result.series["latencies_ms"])
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
        axes.hist(latencies, bins=100, color=MEASURED)
        axes.axvline(p50, color="tab:green", label=f"p50 {p50:.1f} ms")
        axes.axvline(p99, color="tab:red", label=f"p99 {p99:.1f} ms")
        axes.set_title(f"{result.scenario}: {len(latencies):,} messages")
        axes.set_xlabel("latency (ms)")
        axes.set_ylabel("messages")
        axes.legend()
    return _save(figure, path)


def _scale(results: list[ScenarioResult], path: Path) -> Path | None:
    measured = [result for result in results if result.series.get("scale")]
    if not measured:
        return None
    figure = Figure(figsize=(9, 4.5), layout="constrained")
    axes = figure.subplots()
    for result in measured:
        curve = result.series["scale"]
        fastest = max(point["msgs_per_s"] for point in curve)
        axes.axhspan(fastest / SCALE_FLAT_WITHIN, fastest, color="tab:green", alpha=0.12,
                     label=f"the target: within {SCALE_FLAT_WITHIN - 1:.0%} of the fastest point")
        axes.plot([point["conversations"] for point in curve], [point["msgs_per_s"] for point in curve], "o-",
                  label=result.scenario)
        labelled = set()
        for point in curve:  # a second point at the same number of conversations is labelled below it
            below = point["conversations"] in labelled
            labelled.add(point["conversations"])
            axes.annotate(point["label"], (point["conversations"], point["msgs_per_s"]), textcoords="offset points",
                          xytext=(4, -12 if below else 6), fontsize=8)
    axes.set_xscale("log")
    axes.margins(x=0.1)
    axes.xaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
    axes.set_ylim(bottom=0, top=1.15 * max(point["msgs_per_s"] for result in measured for point in result.series["scale"]))
    axes.yaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
    axes.set_xlabel("conversations")
    axes.set_ylabel("msgs/s")
    axes.set_title("Throughput against the number of conversations")
    axes.legend(loc="lower left", fontsize=8)
    return _save(figure, path)


def _soak(results: list[ScenarioResult], path: Path) -> Path | None:
    measured = [result for result in results if result.series.get("soak")]
    if not measured:
        return None
    figure = Figure(figsize=(9, 10), layout="constrained")
    rate, dead, log, memory = figure.subplots(4, 1, sharex=True)
    for result in measured:
        samples = result.series["soak"]
        seconds = [sample["t_s"] for sample in samples]
        rate.plot(seconds, [sample["msgs_per_s"] for sample in samples], label=result.scenario)
        dead.plot(seconds, [sample["dead_tuples"] for sample in samples], color="tab:red")
        log.plot(seconds, [sample["log_rows"] for sample in samples], color="tab:green")
        memory.plot(seconds, [sample["relay_rss_mb"] for sample in samples], label="relay")
        memory.plot(seconds, [sample["api_rss_mb"] for sample in samples], label="API")
        held = [sample["t_s"] for sample in samples if sample.get("holding")]
        for axes in (rate, dead, log, memory) if held else ():
            axes.axvspan(min(held), max(held), color="tab:orange", alpha=0.15)
    rate.set_ylabel("delivered (msgs/s)")
    rate.set_ylim(bottom=0)
    rate.legend(fontsize=8)
    rate.set_title("Soak (shaded: a transaction held open)")
    dead.set_ylabel("dead tuples")
    log.set_ylabel("rows in A's log")
    log.yaxis.set_major_formatter(StrMethodFormatter(THOUSANDS))
    memory.set_ylabel("resident memory (MB)")
    memory.set_xlabel("seconds")
    memory.legend(fontsize=8)
    return _save(figure, path)


def write_charts(results: list[ScenarioResult], folder: Path) -> list[Path]:
    """Writes the charts the results have data for; returns their paths."""
    charts = [(_throughput, "throughput.png"), (_latency, "latency.png"), (_scale, "scale.png"), (_soak, "soak.png")]
    return [path for draw, name in charts if (path := draw(results, folder / name)) is not None]

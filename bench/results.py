"""What a scenario measured, and how it is written down."""
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Measurement:
    """Repeated measurements of one quantity: a rate (higher is better) or a latency."""

    label: str
    unit: str
    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: str
    measured: Measurement | None
    baseline: Measurement | None = None
    target: str = "report"
    # Whether the target was met; None when the scenario only reports.
    met: bool | None = None
    details: dict = field(default_factory=dict)
    # Curves for the charts (throughput over time, latencies, ...), keyed by name.
    series: dict = field(default_factory=dict)
    # Why the scenario did not run, when it did not.
    skipped: str | None = None

    @property
    def ratio(self) -> float | None:
        return self.measured.median / self.baseline.median if self.measured and self.baseline else None


def ratio_met(measured: Measurement, baseline: Measurement, least: float) -> bool:
    return measured.median / baseline.median >= least


def _value(measurement: Measurement) -> str:
    digits = 1 if measurement.median < 100 else 0
    spread = f"{min(measurement.values):,.{digits}f}–{max(measurement.values):,.{digits}f}"
    return f"{measurement.median:,.{digits}f} {measurement.unit} ({spread})"


def markdown_table(results: list[ScenarioResult]) -> str:
    lines = ["| scenario | measured, median (spread) | baseline in the same run, median (spread) | ratio | target | met |",
             "|---|---|---|---|---|---|"]
    for result in results:
        if result.skipped:
            lines.append(f"| {result.scenario} | skipped: {result.skipped} | — | — | {result.target} | — |")
            continue
        baseline = f"{result.baseline.label}: {_value(result.baseline)}" if result.baseline else "—"
        ratio = f"{result.ratio:.2f}" if result.ratio is not None else "—"
        met = {True: "yes", False: "**no**", None: "—"}[result.met]
        lines.append(f"| {result.scenario} | {result.measured.label}: {_value(result.measured)} | {baseline} "
                     f"| {ratio} | {result.target} | {met} |")
    return "\n".join(lines) + "\n"


def write_results(results: list[ScenarioResult], folder: Path, environment: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    document = {"environment": environment,
                "scenarios": [{**asdict(result), "ratio": result.ratio} for result in results]}
    (folder / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    (folder / "results.md").write_text(markdown_table(results))

"""What a scenario measured, and how it is written down."""
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Measurement:
    """Repeated measurements of one rate (higher is better)."""

    label: str
    unit: str
    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: str
    measured: Measurement
    baseline: Measurement | None = None
    # The least ratio of measured to baseline medians the scenario aims for.
    target_ratio: float | None = None
    details: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        return self.measured.median / self.baseline.median if self.baseline else None

    @property
    def met(self) -> bool | None:
        return None if self.target_ratio is None or self.ratio is None else self.ratio >= self.target_ratio


def _rate(measurement: Measurement) -> str:
    spread = f"{min(measurement.values):,.0f}–{max(measurement.values):,.0f}"
    return f"{measurement.median:,.0f} {measurement.unit} ({spread})"


def markdown_table(results: list[ScenarioResult]) -> str:
    lines = ["| scenario | measured, median (spread) | baseline, median (spread) | ratio | target | met |",
             "|---|---|---|---|---|---|"]
    for result in results:
        baseline = f"{result.baseline.label}: {_rate(result.baseline)}" if result.baseline else "—"
        ratio = f"{result.ratio:.2f}" if result.ratio is not None else "—"
        target = f"≥ {result.target_ratio:.2f}×" if result.target_ratio is not None else "—"
        met = {True: "yes", False: "**no**", None: "—"}[result.met]
        lines.append(f"| {result.scenario} | {result.measured.label}: {_rate(result.measured)} | {baseline} "
                     f"| {ratio} | {target} | {met} |")
    return "\n".join(lines) + "\n"


def write_results(results: list[ScenarioResult], folder: Path, environment: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    document = {"environment": environment,
                "scenarios": [{**asdict(result), "ratio": result.ratio, "met": result.met} for result in results]}
    (folder / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    (folder / "results.md").write_text(markdown_table(results))

"""Benchmark outputs: results.json, results.csv, requests.jsonl, pareto.png, ttft_cdf.png,
and the comparison of several result directories (``tokenmill bench compare``).

``results.json`` layout::

    {"endpoint": {"base_url", "model", "label", "prompt_format", "extras"},
     "workload": {...}, "run": {...}, "created_at": ..., "warnings": [...],
     "runs": [{"concurrency": 1, "ttft_p50_s": ..., "output_tokens_per_s": ..., ...,
               "ttft_samples_s": [...]}, ...]}
"""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

# x and y of the pareto chart
INTERACTIVITY = "output_tokens_per_s_per_user"
THROUGHPUT = "total_tokens_per_s_per_device"

CSV_SKIP = {"ttft_samples_s", "error_examples"}

COMPARE_FIELDS = ("output_tokens_per_s", "total_tokens_per_s", "output_tokens_per_s_per_user",
                  "ttft_p50_s", "tpot_mean_s", "e2e_latency_p50_s", "cache_hit_rate",
                  "acceptance_length")


def write_results(out_dir: str | Path, doc: dict[str, Any],
                  records: Sequence[tuple[int, list[dict[str, Any]]]]) -> list[Path]:
    """Write every output file; returns their paths. ``records`` holds (concurrency, raw
    request records) per level, written to requests.jsonl."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.csv", out / "requests.jsonl", out / "pareto.png",
             out / "ttft_cdf.png"]
    paths[0].write_text(json.dumps(doc, indent=2, default=_json_default))
    write_csv(paths[1], doc["runs"])
    with open(paths[2], "w") as f:
        for c, recs in records:
            for r in recs:
                f.write(json.dumps({"concurrency": c, **r}, default=_json_default) + "\n")
    plot_pareto([(label_of(doc), doc["runs"])], paths[3])
    plot_ttft_cdf(doc["runs"], paths[4], title=label_of(doc))
    return paths


def _json_default(o: object) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_csv(path: Path, runs: Sequence[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r if k not in CSV_SKIP and k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in runs:
            w.writerow({k: r.get(k) for k in keys})


def label_of(doc: dict[str, Any]) -> str:
    ep = doc.get("endpoint", {})
    return str(ep.get("label") or ep.get("model") or ep.get("base_url") or "endpoint")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(series: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: str | Path) -> None:
    """Interactivity (x) vs throughput (y), one line per endpoint, points labelled with the
    concurrency."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    for label, runs in series:
        pts = sorted((r["concurrency"], r.get(INTERACTIVITY), r.get(THROUGHPUT)) for r in runs)
        pts = [p for p in pts if p[1] is not None and p[2] is not None]
        if not pts:
            continue
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", label=label)
        for c, x, y in pts:
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("interactivity: output tokens/s per user (1 / mean TPOT)")
    ax.set_ylabel("throughput: total tokens/s per device")
    ax.set_title("interactivity vs throughput (labels: concurrency)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_cdf(runs: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in runs:
        xs = sorted(r.get("ttft_samples_s") or [])
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"concurrency {r['concurrency']}")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF {title}".strip())
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- compare

class ComparedRun(NamedTuple):
    label: str
    doc: dict[str, Any]


def load_results(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    f = p / "results.json" if p.is_dir() else p
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read benchmark results from {f}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ValueError(f"{f} is not a tokenmill bench results.json (no 'runs' list)")
    return doc


def _unique_labels(docs: Sequence[dict[str, Any]], paths: Sequence[str | Path]) -> list[str]:
    labels = [label_of(d) for d in docs]
    if len(set(labels)) < len(labels):
        labels = [f"{lab} ({Path(p).name})" for lab, p in zip(labels, paths)]
    return labels


def compare_table(runs: Sequence[ComparedRun], fields: Sequence[str] = COMPARE_FIELDS) -> str:
    """A text table: for each concurrency level every endpoint's value of each field and its
    ratio to the first (baseline) endpoint."""
    base = runs[0]
    levels = sorted({r["concurrency"] for cr in runs for r in cr.doc["runs"]})
    by = [{r["concurrency"]: r for r in cr.doc["runs"]} for cr in runs]
    lines = [f"baseline: {base.label}; cells are value (ratio to baseline)"]
    header = ["conc", "metric", *[cr.label for cr in runs]]
    rows = []
    for c in levels:
        for fld in fields:
            b = by[0].get(c, {}).get(fld)
            cells = []
            for d in by:
                v = d.get(c, {}).get(fld)
                if v is None:
                    cells.append("-")
                elif b not in (None, 0):
                    cells.append(f"{v:.4g} ({v / b:.2f}x)")
                else:
                    cells.append(f"{v:.4g}")
            rows.append([str(c), fld, *cells])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*header))
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)


def compare(paths: Sequence[str | Path], out: str | Path | None = None) -> tuple[str, Path | None]:
    """Load result dirs, overlay them on one pareto chart (``out``, default
    ``compare_pareto.png`` beside the first) and return (table, chart path)."""
    if not paths:
        raise ValueError("compare needs at least one results directory")
    docs = [load_results(p) for p in paths]
    labels = _unique_labels(docs, paths)
    runs = [ComparedRun(lab, d) for lab, d in zip(labels, docs)]
    chart = Path(out) if out else (Path(paths[0]) if Path(paths[0]).is_dir() else Path(paths[0]).parent) / "compare_pareto.png"
    plot_pareto([(cr.label, cr.doc["runs"]) for cr in runs], chart)
    return compare_table(runs), chart

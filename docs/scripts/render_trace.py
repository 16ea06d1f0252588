"""Render Chrome trace-event JSON files written by ``rlinf fit --trainer.trace=PATH`` as one SVG
Gantt chart: a panel per trace (shared time axis), a row per worker, a bar per stage call.

    python docs/scripts/render_trace.py docs/traces/collocated.json docs/traces/hybrid.json \
        -o docs/img/traces.svg

Stage calls on a micro-batch are full-height bars; end-of-iteration work (``<stage>.end_iteration``,
e.g. the actor's optimizer step) is hatched; weight syncs (``sync_state``, ``apply_sync``,
``sync_broadcast``, ``sync_receive``) are black. Offload/onload spans are grey.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

STAGE_COLORS = {
    "rollout": "#4c78a8",
    "reward": "#f58518",
    "advantage": "#54a24b",
    "inference": "#b279a2",
    "actor": "#e45756",
    "env": "#72b7b2",
    "policy": "#4c78a8",
}
SYNC_KINDS = {"sync_state", "apply_sync", "sync_broadcast", "sync_receive"}


def load(path: Path) -> tuple[str, list[str], list[dict]]:
    """(strategy, row labels in order, complete events) of one trace file."""
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    rows = [names[p] for p in sorted(names)]
    spans = [e for e in events if e["ph"] == "X"]
    return data.get("otherData", {}).get("strategy", path.stem), rows, spans


def color(span: dict) -> tuple[str, str | None]:
    kind, stage = span["cat"], span["args"]["stage"]
    if kind in SYNC_KINDS:
        return "black", None
    if kind in ("offload", "onload"):
        return "#bbbbbb", None
    return STAGE_COLORS.get(stage, "#9d9d9d"), ("////" if kind != "process" else None)


def render(paths: list[Path], out: Path, titles: list[str] | None = None) -> None:
    traces = [load(p) for p in paths]
    end = max((s["ts"] + s["dur"]) / 1e6 for _, _, spans in traces for s in spans)
    heights = [max(1, len(rows)) * 0.55 + 0.6 for _, rows, _ in traces]
    plt.rcParams["svg.hashsalt"] = "rlinf-lightning-docs"  # stable ids: the SVG diffs cleanly
    plt.rcParams["svg.fonttype"] = "none"  # text as text: smaller, and searchable
    fig, axes = plt.subplots(
        len(traces), 1, figsize=(10, sum(heights) + 0.9), sharex=True, height_ratios=heights, squeeze=False
    )
    stages_seen: dict[str, str] = {}
    for i, (ax, (strategy, rows, spans)) in enumerate(zip(axes[:, 0], traces, strict=True)):
        for s in spans:
            face, hatch = color(s)
            if s["cat"] == "process" or hatch:
                stages_seen.setdefault(s["args"]["stage"], face)
            row = s["pid"]
            ax.broken_barh(
                [(s["ts"] / 1e6, s["dur"] / 1e6)],
                (row - 0.4, 0.8),
                facecolors=face,
                edgecolor="white" if hatch else "none",
                linewidth=0.3,
                hatch=hatch,
            )
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_title(titles[i] if titles else strategy, fontsize=10, loc="left")
        ax.grid(axis="x", linewidth=0.3)
    axes[-1, 0].set_xlim(0, end * 1.01)
    axes[-1, 0].set_xlabel("seconds since the first stage call")
    handles = [Patch(facecolor=c, label=n) for n, c in stages_seen.items()]
    handles += [
        Patch(facecolor="white", edgecolor="black", hatch="////", label="end of iteration (optimizer step)"),
        Patch(facecolor="black", label="weight sync"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path, help="Chrome trace JSON files (one panel each)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="SVG (or PNG) file to write")
    ap.add_argument("--titles", nargs="*", help="panel titles (default: each trace's strategy)")
    args = ap.parse_args()
    render(args.traces, args.output, args.titles)


if __name__ == "__main__":
    main()

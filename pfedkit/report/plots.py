"""PNG figures from a run folder's files (metrics.jsonl, partition.json), so `pfedkit plot DIR` can redraw them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import short_repr
from ..errors import PfedkitError


class _Pyplot:
    """matplotlib.pyplot, imported (with the Agg backend) at the first figure: importing it costs about a second,
    which every Flower ClientApp process (one per message) would otherwise pay for nothing."""

    def __getattr__(self, name):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
        return getattr(pyplot, name)


plt = _Pyplot()


def save_figure(fig, path: Path) -> Path:
    """Written whole or not at all (a full disk keeps the previous figure), the error naming the file; a legend
    placed beside the axes is inside the picture (bbox 'tight')."""
    from ..engine.files import atomic_write
    try:
        fig.tight_layout()
        atomic_write(Path(path), lambda fh: fig.savefig(fh, format="png", dpi=110, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return Path(path)


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows; a line that is not a metrics row (a run killed mid-write, an edit) is one PfedkitError."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for i, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem = row_problem(row)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            problem = "is not valid JSON (truncated file?)"
        except RecursionError:  # json's decoder recurses once per level of nesting
            problem = "nests lists or objects too deeply (not a metrics row)"
        if problem:
            raise PfedkitError(f"{path}: line {i} {problem}; finish the run with `pfedkit run --resume "
                               f"{path.parent}`, which rewrites the log from its checkpoint, or delete that line")
        rows.append(row)
    return rows


# what the figures draw: numbers, or null where a run has none (no global model, no train loss logged)
DRAWN = ("global_acc", "train_loss", "personalized_train_loss", "global_train_loss")


def row_problem(row) -> str | None:
    """Why `row` is not a metrics row as a run writes it (a whole round, a personalized accuracy, numbers or null in
    what is drawn), or None: a figure never draws a string, and a resumed run never continues from such a row."""
    if not isinstance(row, dict):
        return f"is not a metrics row (a JSON object): {short_repr(row)}"
    if "round" not in row:
        return "is not a metrics row (no 'round')"
    if not (isinstance(row["round"], int) and not isinstance(row["round"], bool)):
        return f"is not a metrics row: its 'round' is {short_repr(row['round'])}, not a whole number"
    for key in ("personalized_acc", *DRAWN):
        value = row.get(key)
        if (key == "personalized_acc" or value is not None) and not _is_number(value):
            found = "missing" if key not in row else f"{short_repr(value)}, not a number"
            return f"is not a metrics row: its '{key}' is {found}"
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# A colour of its own for each run of a figure (13 methods and more): tab10, then three that none of it resembles;
# past those, the colours come back with a dash-dot line
PALETTE = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan", "black", "navy", "magenta"]


def style(i: int) -> dict:
    """The i-th run's colour (and, past the palette, line style) in a figure of several runs."""
    return {"color": PALETTE[i % len(PALETTE)], "linestyle": "-" if i < len(PALETTE) else "-."}


def percent(values) -> list:
    """Accuracies as percentages, as every table and the progress bar show them (None stays a gap)."""
    return [None if v is None else 100 * v for v in values]


def _curves(ax_acc, ax_loss, rows: list[dict], label: str, i: int = 0) -> None:
    """One run's curves: its personalized accuracy (solid, labelled) and its global model's (dashed, the same
    colour, unlabelled: the titles say which is which, and the legend stays one entry a run)."""
    rounds = [r["round"] for r in rows]
    look = style(i)
    ax_acc.plot(rounds, percent(r["personalized_acc"] for r in rows), label=label, **look)
    dashed = {**look, "linestyle": "--"}
    if rows and rows[-1].get("global_acc") is not None:
        ax_acc.plot(rounds, percent(r.get("global_acc") for r in rows), **dashed)
    if ax_loss is None:
        return
    if rows and rows[-1].get("personalized_train_loss") is not None:  # eval_train: the models' loss on train data
        ax_loss.plot(rounds, [r.get("personalized_train_loss") for r in rows], **look)
        if rows[-1].get("global_train_loss") is not None:
            ax_loss.plot(rounds, [r.get("global_train_loss") for r in rows], **dashed)
    elif any(r.get("train_loss") is not None for r in rows):
        ax_loss.plot(rounds, [r.get("train_loss") for r in rows], **look)


def _rounds_axis(*axes) -> None:
    """Rounds are whole numbers: no tick at round 1.5."""
    from matplotlib.ticker import MaxNLocator
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend_beside(labelled, right) -> None:
    """The runs of axes `labelled`, one entry each, to the right of axes `right` (the figure's last panel): off
    every curve."""
    handles, labels = labelled.get_legend_handles_labels()
    if handles:
        right.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def plot_accuracy(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    _curves(ax, ax2, rows, run_dir.name)
    ax.set(xlabel="round", ylabel="test accuracy % (mean over clients)",
           title="personalized (solid) and global (dashed) accuracy")
    ax2.set(xlabel="round", ylabel="train loss", title="local training loss")
    ax.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    _rounds_axis(ax, ax2)
    return save_figure(fig, run_dir / "accuracy.png")


def plot_partition(run_dir: Path) -> Path:
    """Per-client class histogram of the training data (stacked bars; a heatmap for many clients)."""
    run_dir = Path(run_dir)
    info = json.loads((run_dir / "partition.json").read_text())
    counts = np.asarray(info["train_counts"])
    n, c = counts.shape
    fig, ax = plt.subplots(figsize=(min(14, 4 + 0.25 * n), 4))
    if n <= 60:
        bottom = np.zeros(n)
        cmap = plt.get_cmap("tab20" if c > 10 else "tab10")
        for k in range(c):
            ax.bar(np.arange(n), counts[:, k], bottom=bottom, color=cmap(k % cmap.N), label=str(k) if c <= 20 else None)
            bottom += counts[:, k]
        if c <= 20:
            ax.legend(title="class", fontsize=7, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
        ax.set(xlabel="client", ylabel="train samples")
    else:
        im = ax.imshow(counts.T, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(im, ax=ax, label="train samples")
        ax.set(xlabel="client", ylabel="class")
    ax.set_title(f"{info['dataset']}: classes per client")
    return save_figure(fig, run_dir / "partition.png")


def plot_comparison(out_dir: Path, run_dirs: list[Path]) -> Path:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, run_dir in enumerate(run_dirs):
        _curves(ax, ax2, read_metrics(run_dir), Path(run_dir).name, i)
    ax.set(xlabel="round", ylabel="test accuracy % (mean over clients)",
           title="personalized (solid) and global (dashed) accuracy")
    ax2.set(xlabel="round", ylabel="train loss", title="training loss")
    if any(line.get_ydata().size for line in ax2.lines):
        ax2.set_yscale("log")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    _rounds_axis(ax, ax2)
    _legend_beside(ax, ax2)
    return save_figure(fig, Path(out_dir) / "comparison.png")


def plot_run(run_dir: Path, layer: str | None = None, client: int = 0) -> list[Path]:
    run_dir = Path(run_dir)
    paths = [plot_accuracy(run_dir)]
    if (run_dir / "partition.json").is_file():
        paths.append(plot_partition(run_dir))
    if (run_dir / "alpha.npz").is_file() and (run_dir / "algorithm.json").is_file():
        paths += plot_alpha(run_dir, layer, client)
    return paths


def seed_band(acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, sample std) over seeds (axis 0) per round; the std is 0 for a single seed (ddof=1 leaves none)."""
    std = acc.std(0, ddof=1) if len(acc) > 1 else np.zeros(acc.shape[1:])
    return acc.mean(0), std


def plot_seed_comparison(out_dir: Path, seed_dirs: list[Path], algorithms: list[str]) -> Path:
    """Mean over seeds per round with a ± sample std band, one line per algorithm: personalized accuracy, and the
    global model's accuracy for the algorithms that have one (pFedCS's claim is about the global model)."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for i, name in enumerate(algorithms):
        runs = [read_metrics(d / name) for d in seed_dirs if (d / name / "summary.json").is_file()]  # finished
        if not runs:
            continue
        length = min(len(r) for r in runs)
        rounds = [row["round"] for row in runs[0][:length]]
        look = style(i)
        for key, axis in (("personalized_acc", ax), ("global_acc", ax2)):
            if any(r[length - 1].get(key) is None for r in runs):
                continue
            acc = 100 * np.array([[row.get(key) for row in r[:length]] for r in runs], dtype=float)
            mean, std = seed_band(acc)
            axis.plot(rounds, mean, label=f"{name} ({len(runs)} seeds)" if axis is ax else "_", **look)
            axis.fill_between(rounds, mean - std, mean + std, color=look["color"], alpha=0.2)
    ax.set(xlabel="round", ylabel="test accuracy % (mean over clients)",
           title="personalized, mean ± sample std over seeds")
    ax2.set(xlabel="round", title="global model, mean ± sample std over seeds")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    _rounds_axis(ax, ax2)
    _legend_beside(ax, ax2)
    return save_figure(fig, Path(out_dir) / "comparison.png")


# ---- pFedLA's aggregation weights (the paper's Figs. 5-7) -----------------------------------------------------------

def _alpha_series(run_dir: Path) -> tuple[list[int], list[np.ndarray]]:
    with np.load(Path(run_dir) / "alpha.npz") as z:
        keys = sorted(k for k in z.files)
        return [int(k.strip("r.npy")) for k in keys], [z[k] for k in keys]


def client_groups(label_sets: list[list[int]], target: int) -> dict[str, list[int]]:
    """Other clients relative to `target` by label sets: the same labels, similar (all but one label shared)
    and the rest, as in the paper's Fig. 5."""
    mine = set(label_sets[target])
    groups = {"same labels": [], "similar (all but one label)": [], "others": []}
    for j, labels in enumerate(label_sets):
        if j == target:
            continue
        shared = len(mine & set(labels))
        if set(labels) == mine:
            groups["same labels"].append(j)
        elif shared >= max(len(mine) - 1, 1) and len(labels) == len(mine):
            groups["similar (all but one label)"].append(j)
        else:
            groups["others"].append(j)
    return groups


def plot_alpha(run_dir: Path, layer: str | None = None, client: int = 0) -> list[Path]:
    """Heatmap of one layer's N x N weights (Fig. 6), one client's weights per layer (Fig. 7), and that client's
    weights on itself / same-label / similar / other clients over training (Fig. 5)."""
    run_dir = Path(run_dir)
    rounds, alphas = _alpha_series(run_dir)
    info = json.loads((run_dir / "algorithm.json").read_text())
    layers = info["alpha_layers"]
    final = alphas[-1]
    n = final.shape[0]
    if not 0 <= client < n:
        raise ValueError(f"client {client} is not one of 0..{n - 1}")
    if layer is None:  # the paper shows FC1 for (E)MNIST-sized models
        layer = "fc1" if "fc1" in layers else layers[0]
    if layer not in layers:
        raise ValueError(f"layer {layer!r} is not one of {', '.join(layers)}")
    paths = []
    part = json.loads((run_dir / "partition.json").read_text())

    # Many clients: ordered by their label sets, so clients that learn the same classes form visible blocks (the
    # structure the paper's Fig. 6 shows at 10 clients), in a picture of bounded size
    many = n > 30
    order = sorted(range(n), key=lambda i: (sorted(part["label_sets"][i]), i)) if many else list(range(n))
    side = min(4.5 + 0.1 * n, 9.0)
    fig, ax = plt.subplots(figsize=(side + 0.7, side))
    im = ax.imshow(final[:, layers.index(layer), :][np.ix_(order, order)], cmap="viridis", vmin=0,
                   interpolation="nearest")
    fig.colorbar(im, ax=ax, label="aggregation weight")
    how = " (clients ordered by label set)" if many else ""
    ax.set(xlabel="source client j", ylabel="target client i",
           title=f"{layer}: weights α_i[j] at round {rounds[-1]}{how}")
    if n <= 12:
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
    paths.append(save_figure(fig, run_dir / "alpha_heatmap.png"))

    fig, ax = plt.subplots(figsize=(min(5.2 + 0.15 * n, 14.0), 1.5 + 0.45 * len(layers)))
    im = ax.imshow(final[client], cmap="viridis", vmin=0, aspect="auto")
    fig.colorbar(im, ax=ax, label="aggregation weight")
    ax.set_yticks(range(len(layers)), layers)
    ax.set(xlabel="source client j", title=f"client {client}'s weights per layer, round {rounds[-1]} (box: self)")
    ax.add_patch(plt.Rectangle((client - 0.5, -0.5), 1, len(layers), fill=False, edgecolor="red", linewidth=2))
    if n <= 12:
        ax.set_xticks(range(n))
        for l in range(len(layers)):
            for j in range(n):
                ax.text(j, l, f"{final[client, l, j]:.2f}", ha="center", va="center", fontsize=7, color="white")
    paths.append(save_figure(fig, run_dir / "alpha_layers.png"))

    groups = client_groups(part["label_sets"], client)
    series = np.stack([a[client].mean(0) for a in alphas])  # (evaluations, N): averaged over layers
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(rounds, series[:, client], label="itself", linewidth=2)
    for label, members in groups.items():
        if members:
            ax.plot(rounds, series[:, members].mean(1), label=f"{label} ({len(members)}), per client")
    ax.set(xlabel="round", ylabel="aggregation weight (mean over layers)",
           title=f"client {client} (labels {part['label_sets'][client]}): whom it aggregates")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, run_dir / "alpha_evolution.png"))
    return paths

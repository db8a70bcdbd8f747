"""PNG figures from a run folder's files (metrics.jsonl, partition.json), so `pfedkit plot DIR` can redraw them."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

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


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows; a line that is not a JSON row (a run killed mid-write, an edit) is one PfedkitError."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for i, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            problem = None if isinstance(row, dict) and "round" in row else "is not a metrics row (no 'round')"
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            problem = "is not valid JSON (truncated file?)"
        if problem:
            raise PfedkitError(f"{path}: line {i} {problem}; finish the run with `pfedkit run --resume "
                               f"{path.parent}`, which rewrites the log from its checkpoint, or delete that line")
        rows.append(row)
    return rows


def _curves(ax_acc, ax_loss, rows: list[dict], label: str, color=None) -> None:
    rounds = [r["round"] for r in rows]
    line, = ax_acc.plot(rounds, [r["personalized_acc"] for r in rows], label=f"{label} personalized", color=color)
    if rows and rows[-1]["global_acc"] is not None:
        ax_acc.plot(rounds, [r["global_acc"] for r in rows], "--", color=line.get_color(), label=f"{label} global")
    if ax_loss is None:
        return
    if rows and rows[-1].get("personalized_train_loss") is not None:  # eval_train: the models' loss on train data
        ax_loss.plot(rounds, [r["personalized_train_loss"] for r in rows], color=line.get_color(),
                     label=f"{label} personalized")
        if rows[-1].get("global_train_loss") is not None:
            ax_loss.plot(rounds, [r["global_train_loss"] for r in rows], "--", color=line.get_color(),
                         label=f"{label} global")
    elif any(r["train_loss"] is not None for r in rows):
        ax_loss.plot(rounds, [r["train_loss"] for r in rows], color=line.get_color(), label=label)


def plot_accuracy(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    _curves(ax, ax2, rows, run_dir.name)
    ax.set(xlabel="round", ylabel="test accuracy (mean over clients)", title="accuracy")
    ax2.set(xlabel="round", ylabel="train loss", title="local training loss")
    ax.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, run_dir / "accuracy.png")


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
    return _save(fig, run_dir / "partition.png")


def plot_comparison(out_dir: Path, run_dirs: list[Path]) -> Path:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run_dir in run_dirs:
        _curves(ax, ax2, read_metrics(run_dir), Path(run_dir).name)
    ax.set(xlabel="round", ylabel="test accuracy (mean over clients)",
           title="personalized (solid) and global (dashed) accuracy")
    ax2.set(xlabel="round", ylabel="train loss", title="training loss")
    ax2.set_yscale("log")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    return _save(fig, Path(out_dir) / "comparison.png")


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
    for name in algorithms:
        runs = [read_metrics(d / name) for d in seed_dirs if (d / name / "summary.json").is_file()]  # finished
        if not runs:
            continue
        length = min(len(r) for r in runs)
        rounds = [row["round"] for row in runs[0][:length]]
        color = None
        for key, axis in (("personalized_acc", ax), ("global_acc", ax2)):
            if any(r[length - 1][key] is None for r in runs):
                continue
            acc = np.array([[row[key] for row in r[:length]] for r in runs], dtype=float)
            mean, std = seed_band(acc)
            line, = axis.plot(rounds, mean, color=color, label=f"{name} ({len(runs)} seeds, ± sample std)")
            color = line.get_color()
            axis.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.2)
    ax.set(xlabel="round", ylabel="test accuracy (mean over clients)",
           title="personalized, mean ± sample std over seeds")
    ax2.set(xlabel="round", title="global model, mean ± sample std over seeds")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        if a.lines:
            a.legend(fontsize=8)
    return _save(fig, Path(out_dir) / "comparison.png")


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

    fig, ax = plt.subplots(figsize=(5.2 + 0.1 * n, 4.5 + 0.1 * n))
    im = ax.imshow(final[:, layers.index(layer), :], cmap="viridis", vmin=0)
    fig.colorbar(im, ax=ax, label="aggregation weight")
    ax.set(xlabel="source client j", ylabel="target client i", title=f"{layer}: weights α_i[j] at round {rounds[-1]}")
    if n <= 12:
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
    paths.append(_save(fig, run_dir / "alpha_heatmap.png"))

    fig, ax = plt.subplots(figsize=(5.2 + 0.15 * n, 1.5 + 0.45 * len(layers)))
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
    paths.append(_save(fig, run_dir / "alpha_layers.png"))

    part = json.loads((run_dir / "partition.json").read_text())
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
    paths.append(_save(fig, run_dir / "alpha_evolution.png"))
    return paths

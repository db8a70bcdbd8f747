"""The README is a front door that works: its "How to add an algorithm" example registers and runs as written,
its set-up commands are CI's, its quick-start commands are valid, its folder tree names every package, and the
links of the README, CONTRIBUTING.md and docs/ lead to files that exist."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from pfedkit import PRESETS
from pfedkit.cli import _parser
from pfedkit.config import load_config
from pfedkit.registry import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
INSTALL = "pip install torch==2.13.0 && pip install -e . && pfedkit run"
TESTS = "pip install torch==2.13.0 && pip install -e '.[test,flower]' && python -m pytest -q -n auto --dist loadgroup --durations=15"


def section(title: str) -> str:
    """The README's text under `## title`, up to the next section."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start: end if end > 0 else None]


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of `text` in `language` ("" for a block without one)."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M)
    return [body for lang, body in blocks if lang == language]


@pytest.fixture
def example(tmp_path, monkeypatch):
    """The example's two blocks run as a user would, in an empty folder; its algorithm unregistered afterwards."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme_example"}
    try:
        for block in code_blocks(section("How to add an algorithm"), "python"):
            exec(compile(block, "README.md", "exec", dont_inherit=True), namespace)  # not this file's __future__
        yield namespace, tmp_path / "runs" / "fedavgm"
    finally:
        ALGORITHMS.pop("fedavgm", None)


def test_the_example_algorithm_registers_and_runs_beside_fedavg(example):
    namespace, out = example
    assert ALGORITHMS["fedavgm"] is namespace["FedAvgM"]
    summaries = {s["algorithm"]: s for s in namespace["summaries"]}
    assert set(summaries) == {"fedavg", "fedavgm"}
    mine = summaries["fedavgm"]
    assert mine["round"] == 5 and len((out / "fedavgm" / "metrics.jsonl").read_text().splitlines()) == 5
    assert mine["personalized_acc"] > mine["majority_label_acc"] + 0.3  # it learns digits in 5 rounds
    assert mine["mb_up_total"] == summaries["fedavg"]["mb_up_total"]  # the same messages as FedAvg
    server = torch.load(out / "fedavgm" / "checkpoint.pt", weights_only=True)["server"]
    assert set(server) == {"weights", "velocity"} and server["velocity"].abs().sum() > 0
    assert "fedavgm" in (out / "comparison.md").read_text()


def test_the_example_server_step_is_fedavg_with_momentum(example):
    namespace, _ = example
    params = namespace["FedAvgMParams"](server_lr=0.5, server_momentum=0.9)
    algo = ALGORITHMS["fedavgm"](params, model=None, num_clients=2)
    state = {"weights": torch.tensor([1.0, 2.0]), "velocity": torch.tensor([0.1, 0.0])}
    updates = {0: {"weights": torch.tensor([0.0, 0.0])}, 1: {"weights": torch.tensor([2.0, 4.0])}}
    new = algo.aggregate(state, updates, {0: 0.25, 1: 0.75}, rnd=1)
    # by hand: mean (1.5, 3.0); change (-0.5, -1.0); velocity 0.9 (0.1, 0) + change = (-0.41, -1.0);
    # weights (1, 2) - 0.5 velocity = (1.205, 2.5)
    assert torch.allclose(new["velocity"], torch.tensor([-0.41, -1.0]))
    assert torch.allclose(new["weights"], torch.tensor([1.205, 2.5]))


def test_the_example_keys_are_checked_like_the_built_in_ones(example):
    with pytest.raises(Exception, match=r"fedavgm\.server_momentum"):
        load_config(None, ["fedavgm.server_momentum=1.5"], algorithms="fedavgm")


def test_the_set_up_commands_are_the_ones_ci_runs():
    assert INSTALL in README and TESTS in README
    assert TESTS in (ROOT / ".ci" / "run").read_text()


def test_the_quick_start_commands_are_valid():
    lines = [line.split("  #")[0].strip() for block in code_blocks(section("Quick start"), "bash")
             for line in block.splitlines() if line.startswith("pfedkit ")]
    assert len(lines) >= 8
    for line in lines:
        args = _parser().parse_args(shlex.split(line)[1:])
        if args.command == "run" and not args.resume:
            seeds = [f"seeds={args.seeds}"] if args.seeds else []
            cfg = load_config(ROOT / args.config if args.config else PRESETS / "default.yaml",
                              args.overrides + seeds, args.algorithms)
            for spec in cfg.algorithms():
                cfg.for_algorithm(spec)


def test_the_folder_tree_names_every_package():
    tree = next(block for block in code_blocks(section("Architecture"), "") if block.startswith("pfedkit/"))
    folders = sorted(p.name for p in (ROOT / "pfedkit").iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders and all(f"  {name}/" in tree for name in folders), (folders, tree)


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_every_relative_link_leads_to_a_file(page):
    path = ROOT / page
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{page}: {target}"


def test_the_speed_levers_are_config_keys():
    from pfedkit.config import load_config as load

    def flat(tree: dict, prefix: str = "") -> set[str]:
        return set().union(*[flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k}
                             for k, v in tree.items()])
    keys = flat(load(None).to_dict())
    levers = re.findall(r"^\| `([^`]+)` \|", section("Speed levers"), flags=re.M)
    assert len(levers) >= 5
    for lever in levers:
        assert lever in keys or re.fullmatch(r"PFEDKIT_[A-Z]+=\w+", lever), lever


def test_the_outputs_page_names_every_file_a_run_writes():
    from pfedkit.engine import folder
    page = (ROOT / "docs" / "outputs.md").read_text(encoding="utf-8")
    for name in sorted(folder.OWN_FILES | folder.OWN_FOLDERS | {folder.MARKER, folder.LOCK, *folder.KEPT}):
        assert f"`{name}" in page or f"/{name}" in page, name

"""docs/configuration.md is generated from the config dataclasses and the algorithms' Params: the file in the
repository is what the generator makes from today's code, every key's default in it is the code's default, and a
key without a meaning (or a meaning without a key) stops the generator instead of leaving the reference behind."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from pfedkit.config import load_config
from pfedkit.report import config_doc

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([^`]+)` \| (.*?) \| (.*?) \| (.*) \|$")


def flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def documented_rows() -> dict[str, tuple[str, str, str]]:
    """key -> (default, allowed, meaning) of every table row of the file."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match and match.group(1) != "key":
            rows[match.group(1)] = match.group(2, 3, 4)
    return rows


def test_the_file_is_what_the_generator_makes_from_the_code():
    assert DOC.read_text(encoding="utf-8") == config_doc.render(), \
        "docs/configuration.md is out of date: run python -m pfedkit.report.config_doc docs/configuration.md"


def test_every_key_of_the_default_config_has_a_row_with_its_default_and_a_meaning():
    rows = documented_rows()
    defaults = flat(load_config(None).to_dict())  # the built-in keys and every algorithm's section
    assert set(defaults) == set(rows)
    for key, value in defaults.items():
        default, _, meaning = rows[key]
        written = yaml.safe_load(default.strip("`"))  # the default as a user would write it in YAML
        if isinstance(value, float):
            written = float(written)  # YAML 1.1 reads 5e-05 (no dot) as text
        assert written == value, key
        assert len(meaning) > 10, key


def test_allowed_values_are_the_fields_choices_and_ranges():
    rows = documented_rows()
    assert rows["model.name"][1] == "`cnn`, `cnn_bn`, `lenet5`, `mlr`, `dnn`"
    assert rows["partition.test_fraction"][1] == "number >= 0.0 and <= 0.9"
    assert rows["partition.dirichlet_alpha"][1] == "number > 0.0"  # open at 0
    assert rows["runtime.cuda_graphs"][1] == "`true`, `false`"
    assert rows["heurpfedla.k"][0] == "`1`" and rows["pfedla.k"][0] == "`0`"  # HeurpFedLA's own default
    assert rows["pfedcs.lamda"][2] == rows["pfedme.lamda"][2]  # an inherited key reads its parent's meaning


def test_the_resumable_keys_are_named():
    from pfedkit.engine.files import RESUMABLE_KEYS
    line = next(l for l in DOC.read_text(encoding="utf-8").splitlines() if l.startswith("A resumed run"))
    named = set(re.findall(r"`([a-z_.]+)`", line.split("no others:")[1]))
    assert named == {k for k in flat(load_config(None).to_dict())
                     if k in RESUMABLE_KEYS or k.split(".")[0] in RESUMABLE_KEYS}


def test_a_key_without_a_meaning_stops_the_generator(monkeypatch):
    monkeypatch.delitem(config_doc.MEANINGS, "local.lr")
    with pytest.raises(KeyError, match=r"'local\.lr' has no meaning"):
        config_doc.render()
    monkeypatch.delitem(config_doc.ALGORITHM_MEANINGS, "pfedme.eta")
    monkeypatch.setitem(config_doc.MEANINGS, "local.lr", "restored")
    with pytest.raises(KeyError, match=r"'pfedme\.eta' has no meaning"):  # pfedcs inherits it: still missing
        config_doc.render()


def test_a_meaning_of_a_key_that_is_gone_stops_the_generator(monkeypatch):
    monkeypatch.setitem(config_doc.MEANINGS, "runtime.workers_old", "a key the config no longer has")
    with pytest.raises(KeyError, match="runtime.workers_old"):
        config_doc.render()


def test_check_mode_says_whether_the_file_is_current(tmp_path, capsys):
    path = tmp_path / "configuration.md"
    assert config_doc.main([str(path)]) == 0 and path.read_text(encoding="utf-8") == config_doc.render()
    assert config_doc.main(["--check", str(path)]) == 0
    path.write_text(path.read_text(encoding="utf-8").replace("`0.05`", "`0.5`"), encoding="utf-8")
    assert config_doc.main(["--check", str(path)]) == 1
    assert "out of date" in capsys.readouterr().err


def test_an_algorithm_registered_at_run_time_is_not_documented(monkeypatch):
    from pfedkit.algorithms.base import Algorithm
    from pfedkit.registry import ALGORITHMS

    @dataclasses.dataclass
    class Mine:
        rate: float = 0.1

    class Outside(Algorithm):
        name, Params = "outside", Mine
    Outside.__module__ = "my_project.algorithms"
    monkeypatch.setitem(ALGORITHMS, "outside", Outside)
    assert "outside" not in config_doc.render()

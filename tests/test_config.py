"""Config layering and validation, presets, and the README's config reference matching the code."""
from __future__ import annotations

from pathlib import Path

import pytest

from pfedkit.config import Config, dump_config, load_config
from pfedkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def flat_keys(d: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in d.items():
        if isinstance(v, dict) and v:
            keys += flat_keys(v, f"{prefix}{k}.")
        else:
            keys.append(prefix + k)
    return keys


def test_yaml_then_set_then_algorithms(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 7\nlocal:\n  lr: 0.2\nalgorithm: local\n")
    cfg = load_config(path, ["local.lr=1e-3", "partition.num_clients=20"], algorithms="fedavg,local")
    assert cfg.rounds == 7 and cfg.local.lr == 0.001 and cfg.partition.num_clients == 20
    assert cfg.algorithms() == ["fedavg", "local"]
    assert cfg.local.batch_size == Config().local.batch_size  # untouched keys keep their defaults


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.name=dnn", "dataset.name=digits"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("override, needle", [
    ("partition.test_fraction=1.5", "partition.test_fraction"),
    ("local.batch_size=0", "local.batch_size"),
    ("device=tpu", "device"),
    ("progress=maybe", "progress"),
    ("local=3", "local"),
    ("local.epochs=0", "local.epochs"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


def test_every_preset_loads():
    presets = sorted((ROOT / "configs").rglob("*.yaml"))
    assert presets
    for p in presets:
        load_config(p)


def test_default_preset_is_the_embedded_default_job():
    assert (ROOT / "configs" / "default.yaml").read_text() == (ROOT / "pfedkit" / "default.yaml").read_text()
    cfg = load_config(ROOT / "pfedkit" / "default.yaml")
    # the default job: real MNIST digits, 10 clients, 4 classes each, the small CNN, every algorithm
    assert (cfg.dataset.name, cfg.partition.num_clients, cfg.partition.classes_per_client, cfg.model.name,
            cfg.algorithm) == ("mnist5k", 10, 4, "cnn", "all")


def test_readme_documents_every_config_key():
    readme = (ROOT / "README.md").read_text()
    for key in flat_keys(load_config(None).to_dict()):
        leaf = key.rsplit(".", 1)[-1]
        section = key.split(".")[0]
        assert (f"`{key}`" in readme or f"`.{leaf}`" in readme or f"`{section}.*`" in readme), key


def test_algorithm_variants_carry_their_own_hyperparameters():
    cfg = load_config(None, ["heurpfedla.hn_lr=0.1"], "pfedla,heurpfedla@k=2,heurpfedla@k=3+selfweight=raw")
    assert cfg.algorithms() == ["pfedla", "heurpfedla@k=2", "heurpfedla@k=3+selfweight=raw"]
    one = cfg.for_algorithm("heurpfedla@k=3+selfweight=raw")
    assert one.algorithm_name == "heurpfedla"
    p = one.params("heurpfedla")
    assert (p.k, p.selfweight, p.hn_lr) == (3, "raw", 0.1)  # the section's other values stay
    assert cfg.params("heurpfedla").k == 1  # the shared config is untouched
    # a run's resolved config loads back to the same run
    assert load_config(None, [f"heurpfedla.k={p.k}", "heurpfedla.selfweight=raw", "heurpfedla.hn_lr=0.1"],
                       one.algorithm).for_algorithm(one.algorithm).params("heurpfedla") == p


@pytest.mark.parametrize("spec, needle", [
    ("heurpfedla@k=-1", "heurpfedla.k"),
    ("heurpfedla@kk=1", "heurpfedla.kk"),
    ("fedavg@mu=1", "no hyperparameters"),
    ("fedavg@local.lr=-1", "local.lr"),
    ("fedavg@local.nope=1", "local.nope"),
    ("pfedla,pfedla", "twice"),
    ("heurpfedla@k", "name@key=value"),
])
def test_bad_algorithm_variants_name_the_problem(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [], spec)


def test_variants_may_change_their_local_training_only():
    cfg = load_config(None, [], "fedavg,fedavg@local.lr=0.01+local.batch_size=8")
    one = cfg.for_algorithm("fedavg@local.lr=0.01+local.batch_size=8")
    assert (one.local.lr, one.local.batch_size) == (0.01, 8)
    assert cfg.local.lr == 0.05 and cfg.for_algorithm("fedavg").local.lr == 0.05

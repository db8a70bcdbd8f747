"""Config layering and validation, presets, and the configuration reference (docs/) matching the code."""
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
    presets = sorted((ROOT / "pfedkit" / "configs").rglob("*.yaml"))
    assert presets
    for p in presets:
        load_config(p)


def test_default_preset_is_the_packaged_default_job():
    from pfedkit import PRESETS
    assert PRESETS == ROOT / "pfedkit" / "configs"
    cfg = load_config(PRESETS / "default.yaml")
    # the default job: real MNIST digits, 10 clients, 4 classes each, the small CNN, every algorithm
    assert (cfg.dataset.name, cfg.partition.num_clients, cfg.partition.classes_per_client, cfg.model.name,
            cfg.algorithm) == ("mnist5k", 10, 4, "cnn", "all")


def test_the_configuration_reference_documents_every_config_key():
    reference = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")  # generated: report/config_doc.py
    for key in flat_keys(load_config(None).to_dict()):
        assert f"| `{key}` |" in reference, key


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


@pytest.mark.parametrize("override, key, allowed", [
    ("local.lr=nan", "local.lr", "a finite number > 0"),
    ("local.lr=inf", "local.lr", "a finite number > 0"),
    ("local.lr=-inf", "local.lr", "a finite number > 0"),
    ("local.lr=1e999", "local.lr", "a finite number > 0"),  # float('1e999') is inf
    ("fedprox.mu=nan", "fedprox.mu", "a finite number >= 0"),
    ("partition.test_fraction=nan", "partition.test_fraction", "a finite number >= 0.0 and <= 0.9"),
    ("dataset.synthetic.alpha=.inf", "dataset.synthetic.alpha", "a finite number >= 0"),
    ("target_acc=nan", "target_acc", "a finite number >= 0.0 and <= 1.0"),
])
def test_non_finite_numbers_are_refused_naming_the_key(override, key, allowed):
    # nan < low is False, so a range check alone let nan through
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert msg.startswith(f"config key '{key}': ") and "is not allowed; allowed: " + allowed in msg, msg


def test_non_finite_numbers_are_refused_in_a_file_and_in_a_variant(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("local:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match=r"config key 'local\.lr': nan is not allowed"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"config key 'local\.lr': inf is not allowed"):
        load_config(None, [], "fedavg,fedavg@local.lr=inf")


@pytest.mark.parametrize("content, needle", [
    (b"\xff\xfe rounds: 3\n", "is not UTF-8 text (byte 0xff at offset 0); save it as UTF-8"),
    (b"rounds: 3\nlocal:\n  lr: 0.1\n    epochs: 2: 3\n",
     "is not valid YAML: line 4, column 11: mapping values are not allowed here"),
    (b"rounds: [1, 2\nseed: 3\n",
     "is not valid YAML: line 2, column 5: while parsing a flow sequence: expected ',' or ']', but got ':'"),
    (b"rounds: 3\x00\n", "is not valid YAML: character 9: special characters are not allowed"),
    (b"", "holds no keys"),
    (b"# just a comment\n", "holds no keys"),
    (b"rounds 3 local lr 0.1\n", "must hold a mapping of keys at the top level"),
    (b"- rounds: 3\n", "must hold a mapping of keys at the top level"),
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, content, needle):
    path = tmp_path / "exp.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"config file {path} ") and needle in msg, msg
    assert path.read_bytes() == content


def test_a_config_path_that_is_a_folder_or_missing_says_so(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a folder; give the path of a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_a_utf8_config_with_a_bom_and_comments_still_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes("\ufeff# réglages\nrounds: 3  # trois\n".encode("utf-8"))
    assert load_config(path).rounds == 3


def test_speed_keys_of_earlier_versions_are_read_under_the_runtime_section(tmp_path):
    """`threads` and `local.workers*`/`local.cuda_graphs` moved to `runtime:`; run folders and commands of earlier
    versions still load (in a file and in --set), and a present name given beside an old one keeps its value."""
    cfg = load_config(None, ["threads=3", "local.workers=2", "local.workers_in=threads", "local.cuda_graphs=false"])
    assert (cfg.runtime.threads, cfg.runtime.workers, cfg.runtime.workers_in, cfg.runtime.cuda_graphs) == \
        (3, 2, "threads", False)
    path = tmp_path / "old.yaml"
    path.write_text("threads: 2\nlocal:\n  lr: 0.2\n  workers: 1\nruntime:\n  workers: 4\n")
    cfg = load_config(path)
    assert (cfg.runtime.threads, cfg.runtime.workers, cfg.local.lr) == (2, 4, 0.2)
    assert "threads" not in dump_config(cfg).split("runtime:")[0]  # written back under the present names only
    with pytest.raises(ConfigError, match="runtime.threads"):
        load_config(None, ["threads=-1"])


@pytest.mark.parametrize("spec, key", [
    ("pfedme@local.lr=0.01", "local.lr"),  # pFedMe's steps are eta and personal_lr
    ("perfedavg@local.momentum=0.9", "local.momentum"),  # plain alpha and beta steps
    ("pfedhn@local.lr=0.01", "local.lr"),  # its own inner_lr (5e-3 by default) is the step
    ("pfedhn@inner_steps=5+local.epochs=2", "local.epochs"),  # inner_steps is the local work
])
def test_a_local_key_the_solver_ignores_is_refused_with_one_line(spec, key):
    from pfedkit.algorithms import ALGORITHMS, check_local
    one = load_config(None, [], spec).for_algorithm(spec)
    with pytest.raises(ConfigError, match=f"config key '{key}': {one.algorithm_name}'s local solver does not use it"):
        check_local(ALGORITHMS[one.algorithm_name], one)


@pytest.mark.parametrize("spec", ["pfedhn@inner_lr=0+local.lr=0.01", "pfedhn@local.epochs=2",
                                  "fedavg@local.momentum=0.9", "perfedavg@local.lr=0.01"])
def test_a_local_key_the_solver_uses_is_accepted(spec):
    from pfedkit.algorithms import ALGORITHMS, check_local
    one = load_config(None, [], spec).for_algorithm(spec)
    check_local(ALGORITHMS[one.algorithm_name], one)

"""pfedkit on Flower, for real: Flower's simulation runtime (Ray) and a deployment of Flower's own processes on
127.0.0.1 (flower-superlink, flower-supernode per partition, flwr run of pfedkit's app), each compared with the
in-process engine on the same config; faulty and dying SuperNodes; a ServerApp stopped and resumed.
Skipped only where the `flower` extra is not installed (.ci/run installs it)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="pip install -e '.[flower]'")

from pfedkit import PRESETS  # noqa: E402
from pfedkit.algorithms import ALGORITHMS  # noqa: E402
from pfedkit.cli import main  # noqa: E402
from pfedkit.config import dump_config, load_config  # noqa: E402
from pfedkit.engine import TIMING_KEYS  # noqa: E402
from pfedkit.experiment import run_experiment  # noqa: E402
from pfedkit.flower.loopback import Loopback  # noqa: E402

SMALL = ["dataset.name=mnist5k", "partition.samples_per_client=60", "model.name=cnn", "local.epochs=1",
         "local.batch_size=20", "progress=false", "plots=false", "checkpoint_every=1", "pfedme.local_rounds=3",
         "pfedcs.local_rounds=3"]
RUN_FILES = {"config.yaml", "metrics.jsonl", "summary.json", "partition.json", "algorithm.json", "checkpoint.pt"}


def small(clients: int, rounds: int, algorithms: str, *extra: str):
    return load_config(None, SMALL + [f"partition.num_clients={clients}", f"rounds={rounds}", *extra], algorithms)


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(flower: Path, inprocess: Path, names: list[str]) -> None:
    """Every metrics field but the timings is the same, bit for bit (one arithmetic per client: a Flower ClientApp
    trains a cohort of one, the in-process engine a round's clients together, and a client computes the same either
    way; one thread on both sides, as other thread counts reorder the reductions), and the run folders hold the same
    files."""
    for name in names:
        a, b = rows(flower / name), rows(inprocess / name)
        assert len(a) == len(b), name
        for ra, rb in zip(a, b):
            for key in rb:
                if key not in TIMING_KEYS:
                    assert ra[key] == rb[key], (name, ra["round"], key, ra[key], rb[key])
        assert RUN_FILES <= {p.name for p in (flower / name).iterdir()}, name
        assert {p.name for p in (flower / name).iterdir()} == {p.name for p in (inprocess / name).iterdir()}, name


EVERY = ",".join(ALGORITHMS)  # every registered algorithm


@pytest.mark.parametrize("model", [
    ["partition.num_clients=3", "clients_per_round=2"],  # the CNN, client by client in both runtimes
    ["dataset.name=digits", "model.name=mlr", "partition.num_clients=6", "clients_per_round=3"],  # in lockstep here
], ids=["cnn", "mlr"])
def test_the_simulation_runtime_gives_the_in_process_metrics_for_every_algorithm(tmp_path, model):
    """`pfedkit run --runtime flower`: Flower's simulation runtime, one virtual SuperNode per client, a cohort of one
    each, against the in-process engine's cohorts of a round's clients: the same metrics, bit for bit."""
    extra = ["rounds=2", "fedrep.head_epochs=1", "fedfomo.models=1", "pfedhn.inner_lr=0.005", *model]
    default_job = PRESETS / "default.yaml"  # what `pfedkit run` reads
    run_experiment(load_config(default_job, SMALL + extra, EVERY), tmp_path / "inprocess", log=lambda s: None)
    sets = [arg for item in SMALL + extra for arg in ("--set", item)]
    assert main(["run", "--runtime", "flower", "--algorithms", EVERY, "--out", str(tmp_path / "flower"), *sets]) == 0
    assert_same_metrics(tmp_path / "flower", tmp_path / "inprocess", EVERY.split(","))
    assert (tmp_path / "flower" / "comparison.md").is_file()
    stats = json.loads((tmp_path / "flower" / "flower.json").read_text())
    assert stats["messages"] > 0 and stats["serialized_array_bytes"] > stats["tensor_bytes"]  # .npy framing
    assert main(["plot", str(tmp_path / "flower")]) == 0  # pfedkit plot reads the Flower run folder


def wait_for_rows(folder: Path, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (folder / "metrics.jsonl").is_file() and len(rows(folder)) >= count:
            return
        time.sleep(0.5)
    raise AssertionError(f"{folder} did not reach {count} metrics rows in {timeout:.0f} s")


def self_signed_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """docs/flower.md's TLS recipe: a CA, and a server certificate for localhost / 127.0.0.1 signed by it (openssl)."""
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    for step in ("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.crt -subj /CN=pfedkit-ca",
                 "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=localhost",
                 "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.pem -days 2 "
                 "-extfile san.ext"):
        subprocess.run(step.split(), cwd=folder, check=True, capture_output=True)
    return folder / "ca.crt", folder / "server.pem", folder / "server.key"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificates")
def test_a_tls_loopback_deployment_gives_the_in_process_metrics_and_resumes_after_the_serverapp_is_stopped(tmp_path):
    """Two SuperNodes on 127.0.0.1 behind a SuperLink serving TLS with self-signed certificates (the SuperNodes and
    the flwr CLI trust the CA). A 2-round pFedMe run (its clients keep personal models between rounds, in
    context.state) whose ServerApp is stopped after its round-1 checkpoint, then submitted again with resume=true (a
    new Flower run: fresh context.state, the clients' states come back from their nodes' state files), has the
    in-process engine's metrics in every round: round 1 from the first run, round 2 from the resumed one."""
    resumed = small(2, 2, "pfedme")
    (tmp_path / "resumed.yaml").write_text(dump_config(resumed))
    run_experiment(resumed, tmp_path / "resumed_inprocess", log=lambda s: None)
    with Loopback(2, tmp_path / "flwr", tls=self_signed_certificates(tmp_path)) as dep:
        assert "insecure" not in (tmp_path / "flwr" / "config.toml").read_text()
        out = tmp_path / "resumed_flower"
        run_id = dep.submit(config=tmp_path / "resumed.yaml", out=out)
        wait_for_rows(out / "pfedme", 1, 300)
        deadline = time.monotonic() + 60
        while not (out / "pfedme" / "checkpoint.pt").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        dep.flwr("stop", str(run_id), "loopback")  # the ServerApp is killed
        time.sleep(2)
        assert not (out / "pfedme" / "summary.json").exists()
        run_id = dep.submit(config=tmp_path / "resumed.yaml", out=out, resume=True)
        assert "completed" in dep.wait(run_id, 600, ending=lambda: (out / "pfedme" / "summary.json").is_file()), \
            dep.log_of(run_id)[-2000:]
        assert_same_metrics(out, tmp_path / "resumed_inprocess", ["pfedme"])
    states = sorted(p.name for p in (out / ".client_states" / "pfedme").iterdir())
    assert states == ["client0", "client1"]  # what the resumed run's clients read back


def test_faulty_and_dying_supernodes_are_named_and_the_run_goes_on(tmp_path):
    """Three SuperNodes: 0 sound, 1 sends NaN, 2 sound and SIGKILLed after round 1. Each round completes with client 0
    (and 2 while it lives); the faulty client is named in the log with its round, the dead one as missing; the
    server state only ever takes the sound updates. With min-replies=3 (two sound nodes of three) the first round
    stops the run, with one line. (A wrongly shaped reply is refused by the same check, tests/test_trust.py; every
    Flower run above carries the shapes through Flower's records.)"""
    cfg = small(3, 2, "fedavg")
    (tmp_path / "cfg.yaml").write_text(dump_config(cfg))
    with Loopback(3, tmp_path / "flwr", node_config={1: "fault='nan'"}) as dep:
        out = tmp_path / "faulty"
        # the reply timeout is what round 2 waits for the dead node, in training and in evaluation: long enough for a
        # sound client's first reply (it loads its data) on a loaded machine, short enough not to idle
        run_id = dep.submit(config=tmp_path / "cfg.yaml", out=out, timeout=15.0)
        wait_for_rows(out / "fedavg", 1, 300)
        dep.kill_node(2)
        assert "completed" in dep.wait(run_id, 600, ending=lambda: (out / "fedavg" / "summary.json").is_file()), \
            dep.log_of(run_id)[-2000:]
        log = dep.log_of(run_id)
        for rnd in (1, 2):
            assert f"round {rnd}: client 1 sent non-finite values in 'weights'" in log
        assert "no reply from clients [2]" in log or "client 2 failed" in log
        metrics = rows(out / "fedavg")
        assert [r["aggregated"] for r in metrics] == [2, 1]  # clients 0 and 2, then 0 alone: 2 is gone
        assert metrics[-1]["personalized_acc"] >= 0.0 and (out / "fedavg" / "summary.json").is_file()

        dep.start_node(2)  # a sound SuperNode for partition 2 again
        stopped = tmp_path / "stopped"
        run_id = dep.submit(config=tmp_path / "cfg.yaml", out=stopped, timeout=15.0, **{"min-replies": 3})
        dep.wait(run_id, 300, ending=lambda: (stopped / "fedavg" / "failed.txt").is_file())
        failure = (stopped / "fedavg" / "failed.txt").read_text()
        assert failure.startswith("round 1: 2 of 3 clients sent a usable update (at least 3 needed")
        assert "\n" not in failure

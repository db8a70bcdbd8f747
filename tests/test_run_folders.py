"""A run folder is pfedkit's and one run's at a time: --overwrite deletes only what pfedkit wrote in a folder it
marked, never the working folder or the config being run; a second run or resume of a folder in use is refused
in one line; a resume by another pfedkit is refused unless asked for; a full disk never leaves half a metrics row
or half a figure, and the error names the file."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pfedkit.cli import main
from pfedkit.engine.folder import LOCK, MARKER, holder
from pfedkit.provenance import provenance

DIGITS = ["--set", "dataset.name=digits", "--set", "model.name=mlr", "--set", "partition.num_clients=6",
          "--set", "progress=false", "--set", "plots=false"]
RUN = ["run", "--algorithms", "fedavg", *DIGITS, "--set", "rounds=2"]


def refused(capsys, *args: str) -> str:
    """The one error line of a command that must fail."""
    code = main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("pfedkit: error: "), err
    return err[0]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != LOCK}


def a_run(tmp_path: Path, capsys, *extra: str) -> Path:
    out = tmp_path / "exp"
    assert main([*RUN, *extra, "--out", str(out)]) == 0
    capsys.readouterr()
    return out


def project(folder: Path) -> dict[str, bytes]:
    """A user's project folder: what the probe lost to --overwrite."""
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "main.py").write_text("print('my work')\n")
    (folder / "README.txt").write_text("my notes\n")
    (folder / "config.yaml").write_text("rounds: 2\nalgorithm: fedavg\n")
    return files_of(folder)


# ---- --overwrite deletes only pfedkit's own runs ---------------------------------------------------------------

def test_overwrite_never_deletes_a_folder_pfedkit_did_not_make(tmp_path, capsys):
    mine = tmp_path / "project"
    before = project(mine)
    line = refused(capsys, *RUN, "--out", str(mine), "--overwrite")
    assert str(mine) in line and "not a pfedkit run" in line
    assert files_of(mine) == before


def test_overwrite_of_the_current_folder_from_inside_a_project_deletes_nothing(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "project"
    before = project(mine)
    monkeypatch.chdir(mine)
    refused(capsys, "run", "config.yaml", *DIGITS, "--out", ".", "--overwrite")
    assert files_of(mine) == before


@pytest.mark.parametrize("where", ["the run itself", "a run inside it"])
def test_overwrite_never_deletes_the_current_folder_even_when_it_is_a_run(tmp_path, capsys, monkeypatch, where):
    out = a_run(tmp_path, capsys)
    before = files_of(out)
    monkeypatch.chdir(out if where == "the run itself" else out / "fedavg")
    line = refused(capsys, *RUN, "--out", str(out), "--overwrite")
    assert "current folder" in line
    assert files_of(out) == before


def test_overwrite_never_deletes_the_config_being_run(tmp_path, capsys):
    out = a_run(tmp_path, capsys)
    before = files_of(out)
    line = refused(capsys, "run", str(out / "config.yaml"), "--out", str(out), "--overwrite")
    assert "holds the config being run" in line
    assert files_of(out) == before


def test_overwrite_stops_before_deleting_anything_when_a_run_holds_a_file_pfedkit_did_not_write(tmp_path, capsys):
    out = a_run(tmp_path, capsys, "--algorithms", "local,fedavg")
    (out / "fedavg" / "analysis.py").write_text("# the user's own script\n")
    before = files_of(out)
    line = refused(capsys, *RUN, "--out", str(out), "--overwrite")
    assert str(out / "fedavg" / "analysis.py") in line
    assert files_of(out) == before
    (out / "fedavg" / "analysis.py").unlink()
    assert main([*RUN, "--out", str(out), "--overwrite"]) == 0  # pfedkit's own files only: replaced
    assert not (out / "local").exists() and (out / MARKER).is_file() and (out / "fedavg" / MARKER).is_file()


# ---- one run at a time in a folder ---------------------------------------------------------------------------

def test_a_folder_in_use_is_refused_to_a_second_run_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "busy"
    first = subprocess.Popen([sys.executable, "-m", "pfedkit", "run", "--algorithms", "fedavg", *DIGITS, "--set",
                              "rounds=1000000", "--set", "checkpoint_every=1", "--out", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "fedavg" / "checkpoint.pt").is_file() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, first.stderr.read()
        for args in ([*RUN, "--out", str(out)], [*RUN, "--out", str(out), "--overwrite"], ["run", "--resume", str(out)],
                     ["run", "--resume", str(out / "fedavg")]):
            line = refused(capsys, *args)
            assert f"in use by another pfedkit run (process {first.pid})" in line, args
        rows = (out / "fedavg" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["round"] for r in rows] == list(range(1, len(rows) + 1))  # one run's rows only
    finally:
        first.send_signal(signal.SIGKILL)  # as a crash: the kernel lets the lock go with the process
        first.communicate(timeout=60)
    assert holder(out) is None


# ---- a resume continues with the pfedkit that started the run ------------------------------------------------

def test_a_resume_by_another_pfedkit_is_refused_unless_asked_and_then_recorded(tmp_path, capsys):
    from pfedkit.config import load_config
    from pfedkit.experiment import run_experiment
    out = tmp_path / "exp"
    run_experiment(load_config(None, [a for a in DIGITS if a != "--set"] + ["rounds=4", "checkpoint_every=2"],
                               "fedavg"), out, log=lambda s: None, stop_after=2)
    older = {"pfedkit": {"version": "0.0.9", "source": "0123456789abcdef"}}  # what another pfedkit recorded
    (out / MARKER).write_text(json.dumps(older))
    before = files_of(out)
    line = refused(capsys, "run", "--resume", str(out))
    assert "pfedkit 0.0.9 (source 0123456789abcdef)" in line and provenance()["source"] in line
    assert "--allow-version-change" in line
    assert files_of(out) == before
    assert main(["run", "--resume", str(out), "--allow-version-change"]) == 0
    assert json.loads((out / MARKER).read_text())["pfedkit"] == provenance()
    assert json.loads((out / "fedavg" / "summary.json").read_text())["pfedkit"] == provenance()


def test_a_run_without_a_marker_is_of_an_older_pfedkit_and_resumes_only_when_asked(tmp_path, capsys):
    from pfedkit.config import load_config
    from pfedkit.experiment import run_experiment
    out = tmp_path / "exp"
    run_experiment(load_config(None, [a for a in DIGITS if a != "--set"] + ["rounds=4", "checkpoint_every=2"],
                               "fedavg"), out, log=lambda s: None, stop_after=2)
    for marker in out.rglob(MARKER):
        marker.unlink()
    assert "an unrecorded pfedkit version" in refused(capsys, "run", "--resume", str(out / "fedavg"))
    assert main(["run", "--resume", str(out / "fedavg"), "--allow-version-change"]) == 0


# ---- a full disk: whole rows, whole figures, the file named ----------------------------------------------------

APPEND_ON_A_FULL_DISK = r"""
import resource, signal, sys
from pfedkit.engine.files import append_line
from pfedkit.errors import PfedkitError
path = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
size = len(open(path, "rb").read())
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, size + 40))  # room for 40 bytes of the next 200-byte row
try:
    append_line(path, '{"round": 3, "personalized_acc": ' + "1" * 160 + '}')
except PfedkitError as exc:
    print(exc)
"""


def test_a_metrics_row_that_does_not_fit_is_cut_back_and_the_file_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = '{"round": 1, "personalized_acc": 0.5}\n{"round": 2, "personalized_acc": 0.6}\n'
    path.write_text(rows)
    done = subprocess.run([sys.executable, "-c", APPEND_ON_A_FULL_DISK, str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"could not write {path}" in done.stdout and "File too large" in done.stdout
    assert path.read_text() == rows  # no half row at the end


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_figure_that_does_not_fit_keeps_the_previous_one_and_names_the_file(tmp_path, capsys):
    out = a_run(tmp_path, capsys, "--set", "plots=true")
    figure = out / "fedavg" / "accuracy.png"
    saved = figure.read_bytes()
    (out / "fedavg" / "accuracy.png.tmp").symlink_to("/dev/full")  # the figure's first write lands on a full device
    line = refused(capsys, "plot", str(out))
    assert f"could not write {figure}: No space left on device" in line and "intact" in line
    assert figure.read_bytes() == saved
    assert not (out / "fedavg" / "accuracy.png.tmp").exists()


# ---- out of threads: the same run, on the threads there are ----------------------------------------------------

NO_THREADS = r"""
import sys, threading
threading.stack_size(1 << 44)  # every new thread's stack is refused: "can't start new thread"
from pfedkit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_that_can_start_no_thread_gives_the_same_metrics(tmp_path):
    args = ["run", "--algorithms", "fedavg,pfedme", *DIGITS, "--set", "rounds=2", "--set", "runtime.threads=2",
            "--set", "runtime.workers=2", "--set", "runtime.workers_in=threads"]
    rows = {}
    for name, script in (("threads", "import sys; from pfedkit.cli import main; sys.exit(main(sys.argv[1:]))"),
                         ("none", NO_THREADS)):
        done = subprocess.run([sys.executable, "-c", script, *args, "--out", str(tmp_path / name)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        rows[name] = [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
                      for algo in ("fedavg", "pfedme")
                      for line in (tmp_path / name / algo / "metrics.jsonl").read_text().splitlines()]
    assert rows["none"] == rows["threads"]


def test_ctrl_c_during_a_file_write_lands_after_the_file_is_whole(tmp_path):
    """A checkpoint is written whole even when Ctrl-C comes in the middle (PyTorch's zip writer, cut by the
    interrupt, raised its own error or aborted the process at exit, 1 run in ~15): the signal is held while the file
    is written and renamed into place, then raised as the KeyboardInterrupt it is."""
    import torch
    from pfedkit.engine.files import atomic_write
    path = tmp_path / "checkpoint.pt"
    state = {"weights": torch.arange(100_000, dtype=torch.float32)}

    def interrupted_save(fh):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C arrives while the tensors stream out
        torch.save(state, fh)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, interrupted_save)
    assert torch.equal(torch.load(path, weights_only=True)["weights"], state["weights"])
    assert not (tmp_path / "checkpoint.pt.tmp").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back

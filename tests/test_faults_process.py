"""Processes of a sweep: one process per run (a lock file next to the run's checkpoint;
a second worker, or a single run, on a run that a live process trains refuses naming
it; a lock left by a dead process is taken over with a warning), and a SIGTERM to the
sweep reaches its workers, which it waits for. CPU, the tiny network on the bundled
sample of CIFAR-10."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from studies.cifar import cli as cifar
from studies.cifar import runtime, sweep
from studies.cifar.config import RunConfig
from studies.kit.run_lock import RunLockedError, run_lock

ROOT = Path(__file__).resolve().parent.parent


def _job(tmp_path: Path, **kw) -> dict:
    return {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 1,
            "lr": 0.1, "device": "cpu", "out": str(tmp_path / "res"),
            "checkpoint_dir": str(tmp_path / "ck"), "train_subset": 200,
            "method": "sgd", **kw}


def _lock_file(job: dict) -> Path:
    return runtime.checkpoint_path_for(RunConfig(**job)).parent / "run.lock"


def _metrics(job: dict) -> Path:
    return runtime.run_dir_for(RunConfig(**job)) / "metrics.json"


def test_a_second_worker_on_a_live_run_refuses(tmp_path):
    job = _job(tmp_path)
    with sweep.run_lock_for(RunConfig(**job)):  # a live process trains it
        failures = sweep.worker([job], "second", None)
    assert len(failures) == 1
    err = failures[0]["error"]
    assert err.startswith("RunLockedError: ") and str(_lock_file(job)) in err
    assert f"is being trained by process {os.getpid()} on " in err
    assert not _metrics(job).exists()


def test_a_single_run_on_a_live_run_refuses(tmp_path, caplog):
    job = _job(tmp_path)
    argv = ["--source", "sample", "--model", "tiny", "--batch-size", "100", "--epochs",
            "1", "--lr", "0.1", "--device", "cpu", "--out", job["out"],
            "--checkpoint-dir", job["checkpoint_dir"], "--train-subset", "200",
            "--method", "sgd", "--no-progress"]
    with sweep.run_lock_for(RunConfig(**job)):
        assert cifar.main(argv) == 2
    assert "is being trained by process" in caplog.text
    assert not _metrics(job).exists()


def test_a_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    job = _job(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    lock = _lock_file(job)
    lock.parent.mkdir(parents=True)
    lock.write_text(f"process {dead} on this host\n")
    assert sweep.worker([job], "after-a-kill", None) == []
    assert f"of process {dead} on this host, which no longer runs, taken over" \
        in caplog.text
    assert json.loads(_metrics(job).read_text())["complete"]
    assert not lock.exists()


def test_the_lock_is_released_and_its_folders_tidied(tmp_path):
    path = tmp_path / "a" / "b" / "run.lock"
    with run_lock(path, "run x"):
        with pytest.raises(RunLockedError, match="run x is being trained by process"):
            with run_lock(path, "run x"):
                pass
    assert list(tmp_path.iterdir()) == []
    with run_lock(path):  # free again
        assert path.read_text().startswith(f"process {os.getpid()} on ")


def test_sigterm_to_a_sweep_reaches_its_worker(tmp_path):
    job = _job(tmp_path, epochs=500)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([job]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "studies", "cifar", "sweep", "--plan",
         str(plan), "--gpus", "0", "--procs-per-gpu", "1"], cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock, deadline = _lock_file(job), time.monotonic() + 90
    try:
        while not lock.exists() or not lock.read_text():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the worker never took its run"
            time.sleep(0.2)
        pid = int(lock.read_text().split()[1])
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert rc == 128 + signal.SIGTERM, err
    assert "SIGTERM received, passed on to 1 worker(s); waiting for them" in err
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker is gone (and was reaped by the sweep)


FORWARD = """
import subprocess, sys
from studies.cifar.sweep import _wait_forwarding
# as a worker does: hear SIGINT even when started with it ignored (a background job)
KID = ("import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
       "time.sleep(60)")
kids = [subprocess.Popen([sys.executable, "-c", KID], start_new_session=True)
        for _ in range(2)]
print(" ".join(str(k.pid) for k in kids), flush=True)
sys.exit(_wait_forwarding(kids))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_sweep_passes_a_signal_on_and_waits(sig):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", FORWARD], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        time.sleep(0.5)  # the handlers are in place once the children run
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

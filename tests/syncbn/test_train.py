"""scripts/train.py: N ranks with SyncBatchNorm equal one process with BatchNorm on the global batch.

The reference is recomputed here, in the test process (one process, plain
torch.nn.BatchNorm2d, the concatenated per-step batches), independently of the
check the ranks run themselves. Short runs: 101 training images, so shards are
uneven and the last step of an epoch is short (or empty on some rank).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from collectives.launcher import without_launcher_variables

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "scripts" / "train.py"
SHORT = ["--epochs", "1", "--train-images", "101", "--batch", "16", "--no-progress"]


def load_train():
    """scripts/train.py as a module (scripts/ is not a package)."""
    module = sys.modules.get("collectives_train_script")
    if module is None:
        spec = importlib.util.spec_from_file_location("collectives_train_script", TRAIN)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def train_job(comm, argv):
    train = load_train()
    return train.run(comm, train.parse_args(argv))


def reference_params(argv, size):
    """Parameters and running stats of the one-process BatchNorm run, computed here."""
    train = load_train()
    cfg = train.parse_args(argv)
    model = train.train_reference(cfg, train.load_digits(cfg.train_images), size, torch.device("cpu"))
    return train._params(model).numpy(), train._running_stats(model).numpy()


@pytest.mark.parametrize("world, batch", [(("mpi", 2), 16), (("mpi", 3), 11), (("torch", 2), 16),
                                          (("torch", 3), 16)], indirect=["world"])
def test_syncbn_training_equals_one_process_on_the_global_batch(world, batch, tmp_path):
    # mpi 3 ranks, batch 11: shards 34/34/33 need 4 steps; rank 2's last batch is empty.
    argv = [*SHORT, "--batch", str(batch), "--check", "--checkpoint", str(tmp_path / "ck.pt")]
    results = world.run(train_job, args=(argv,), timeout=120)
    want_params, want_stats = reference_params(argv, world.size)
    for summary in results:
        assert summary["ok"] is True
        assert summary["ranks_disagree"] == 0.0
        np.testing.assert_allclose(summary["params"], want_params, rtol=0, atol=1e-5)
        np.testing.assert_allclose(summary["running_stats"], want_stats, rtol=0, atol=1e-5)
        assert max(summary["sync_param_diff"], summary["sync_stat_diff"]) <= 1e-5
        # The unsynced control really differs: the check can tell the two apart.
        assert max(summary["control_param_diff"], summary["control_stat_diff"]) > 1e-3
    moved = np.abs(want_params - reference_params([*argv, "--steps-per-epoch", "1"], world.size)[0]).max()
    assert moved > 1e-3, "training moved the parameters past the first step"


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_check_fails_with_per_rank_batchnorm(world, tmp_path):
    argv = [*SHORT, "--check", "--norm", "local", "--checkpoint", str(tmp_path / "ck.pt")]
    results = world.run(train_job, args=(argv,), timeout=120)
    assert all(summary["ok"] is False for summary in results)


@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_resume_from_checkpoint_equals_an_uninterrupted_run(world, tmp_path):
    common = ["--epochs", "3", "--train-images", "101", "--batch", "16", "--steps-per-epoch", "2",
              "--no-progress"]
    whole = world.run(train_job, args=([*common, "--checkpoint", str(tmp_path / "a.pt")],), timeout=120)
    first = [*common, "--checkpoint", str(tmp_path / "b.pt")]
    first[1] = "1"  # --epochs 1, then resume to 3
    world.run(train_job, args=(first,), timeout=120)
    assert torch.load(tmp_path / "b.pt", weights_only=True)["epoch"] == 1
    resumed = world.run(train_job, args=([*common, "--checkpoint", str(tmp_path / "b.pt"), "--resume"],),
                        timeout=120)
    for a, b in zip(whole, resumed):
        np.testing.assert_array_equal(b["params"], a["params"])
        np.testing.assert_array_equal(b["running_stats"], a["running_stats"])
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"], "no temporary files left behind"
    saved = torch.load(tmp_path / "b.pt", weights_only=True)
    assert saved["epoch"] == 3


def test_digits_are_read_as_scikit_learn_loads_them():
    from sklearn.datasets import load_digits  # noqa: PLC0415

    images, labels = load_train().digits_arrays()
    data = load_digits()
    np.testing.assert_array_equal(images, data.images)
    np.testing.assert_array_equal(labels, data.target)


def test_momentum_sgd_is_torch_sgd():
    train = load_train()
    torch.manual_seed(0)
    ours = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    opt_ours = train.MomentumSGD(ours, lr=0.05, momentum=0.9)
    opt_theirs = torch.optim.SGD(theirs, lr=0.05, momentum=0.9)
    for step in range(4):
        for params, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            (params[0].sin().sum() * (step + 1) + params[1].square().sum()).backward()
            opt.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _launch(command, tmp_path, backend):
    env = {**os.environ, "COLLECTIVES_BACKEND": backend, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env = without_launcher_variables(env)
    # Its own session, so a timeout kills the launcher's ranks too, not just the launcher.
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{command[0]} did not finish in 180 s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _free_port():
    from collectives.testing.launch import free_port

    return str(free_port())


def _tool(name):
    return str(Path(sys.executable).parent / name)


def test_cli_under_torchrun_passes_the_check_and_exits_cleanly(tmp_path):
    done = _launch([_tool("torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                    "--master_port", _free_port(), str(TRAIN), *SHORT, "--check"], tmp_path, "torch")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SyncBN check passed" in done.stdout


def test_cli_exits_1_when_batchnorm_is_not_synced(tmp_path):
    done = _launch([_tool("mpiexec"), "-n", "2", sys.executable, str(TRAIN), *SHORT, "--check",
                    "--norm", "local"], tmp_path, "mpi")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "SyncBN check FAILED" in done.stdout
    assert "epoch 1/1: train loss" in done.stdout
    assert (tmp_path / "out" / "train_digits.pt").exists()  # the default checkpoint


# -- checkpoints: what --resume says about a file that is not a checkpoint, stale temporary files

def resume_error_job(comm, argv):
    """The SystemExit message --resume gives on this rank (None: it resumed)."""
    try:
        train_job(comm, argv)
    except SystemExit as error:
        return str(error)
    return None


def _resume_argv(checkpoint):
    return [*SHORT, "--checkpoint", str(checkpoint), "--resume"]


def _torch_file(value):
    def write(path):
        torch.save(value, path)
    return write


BAD_CHECKPOINTS = {
    "missing": (lambda path: None, ["no checkpoint at {path} (no such file)"]),
    "empty": (lambda path: path.write_bytes(b""), ["the checkpoint {path} is empty (0 bytes)"]),
    "a directory": (lambda path: path.mkdir(), ["cannot read the checkpoint {path}: Is a directory"]),
    "not a torch file": (lambda path: path.write_text("epoch=3\n"),
                         ["{path} (8 bytes) is not a torch checkpoint: torch.load raised"]),
    "a torch dict of something else": (
        _torch_file({"weights": torch.ones(2)}),
        ["{path} is a torch file but not a checkpoint of scripts/train.py: it lacks 'epoch', "
         "'world_size', 'config', 'model', 'optimizer' (it holds a dict with keys 'weights')"]),
    "a torch tensor": (_torch_file(torch.ones(2)),
                       ["{path} is a torch file but not a checkpoint", "it holds a torch.Tensor"]),
    "a checkpoint without its config": (
        _torch_file({"epoch": 1, "world_size": 1, "config": {"batch": 16}, "model": {},
                     "optimizer": {}}),
        ["{path} is a torch file but not a checkpoint of scripts/train.py: its 'config' lacks "
         "'seed', 'train_images', 'steps_per_epoch'"]),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_resume_from_a_file_that_is_no_checkpoint_names_the_file_and_what_is_wrong(case, tmp_path):
    from collectives.backends.local import LocalCommunicator  # noqa: PLC0415

    write, fragments = BAD_CHECKPOINTS[case]
    path = tmp_path / "ck.pt"
    write(path)
    message = resume_error_job(LocalCommunicator(), _resume_argv(path))
    for fragment in fragments:
        assert fragment.format(path=path) in (message or ""), message


@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
@pytest.mark.parametrize("case", ["empty", "a directory", "a torch dict of something else"])
def test_every_rank_gets_rank_0s_reason_the_checkpoint_cannot_be_resumed(world, case, tmp_path):
    # Only rank 0 reads the file: its reason reaches the others (no rank waits for bytes).
    write, fragments = BAD_CHECKPOINTS[case]
    path = tmp_path / "ck.pt"
    write(path)
    messages = world.run(resume_error_job, args=(_resume_argv(path),), timeout=60)
    assert messages[0] is not None and fragments[0].format(path=path) in messages[0], messages
    assert messages == [messages[0]] * world.size


# A child process that runs save_checkpoint on a state whose pickling stops it mid-write:
# SIGKILLed ("kill"), or blocked until a line arrives on stdin ("block").
WRITER = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("train", sys.argv[1])
train = sys.modules["train"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)

class Stop:
    def __reduce__(self):
        if sys.argv[3] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("writing", flush=True)
        sys.stdin.readline()
        return (int, (0,))

import torch
train.save_checkpoint(sys.argv[2], {"epoch": 7, "model": torch.ones(1000), "stop": Stop()})
"""


def _writer(path, how):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(TRAIN), str(path), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _temp_files(directory):
    return sorted(name for name in os.listdir(directory) if ".tmp." in name)


def test_a_writer_killed_mid_checkpoint_leaves_a_temp_file_that_the_next_save_removes(tmp_path, capsys):
    path = tmp_path / "ck.pt"
    killed = _writer(path, "kill")
    killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    left = _temp_files(tmp_path)
    assert len(left) == 1 and str(killed.pid) in left[0], left
    load_train().save_checkpoint(str(path), {"epoch": 2})
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]
    assert torch.load(path, weights_only=True) == {"epoch": 2}
    assert f"removed the stale temporary checkpoint file {tmp_path / left[0]} (its writer, pid " \
           f"{killed.pid} on this host, is gone)" in capsys.readouterr().err


def test_a_save_keeps_the_temp_file_of_a_writer_still_at_work(tmp_path):
    # Two runs sharing a checkpoint path: the other one's write in progress is not stale.
    path = tmp_path / "ck.pt"
    writer = _writer(path, "block")
    try:
        assert writer.stdout.readline() == "writing\n"
        theirs = _temp_files(tmp_path)
        assert len(theirs) == 1 and str(writer.pid) in theirs[0]
        load_train().save_checkpoint(str(path), {"epoch": 2})
        assert _temp_files(tmp_path) == theirs
        writer.communicate("\n", timeout=120)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 0
    assert _temp_files(tmp_path) == []
    # The other run's, renamed in (its stand-in object is no weight: a full load).
    assert torch.load(path, weights_only=False)["epoch"] == 7


def test_stale_temp_files_are_told_from_live_ones_by_host_pid_and_age(tmp_path, capsys):
    train = load_train()
    host = socket.gethostname()
    path = tmp_path / "ck.pt"
    now = time.time()
    started = now - 60  # the current run began a minute ago
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    gone_pid = gone.pid
    live = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE) for _ in range(2)]
    try:
        files = {  # name: (last written, whether it is stale)
            f"ck.pt.tmp.{host}.{live[0].pid}": (now - 3600, True),  # pid reused
            f"ck.pt.tmp.{host}.{live[1].pid}": (now, False),  # its writer is at work
            f"ck.pt.tmp.{host}.{os.getpid()}": (now, True),  # this process is not writing it
            f"ck.pt.tmp.{host}.{gone_pid}": (now, True),  # its writer has exited
            "ck.pt.tmp.other-host.example.123": (now - 3600, True),  # before this run began
            "ck.pt.tmp.other-host.example.456": (now, False),  # may be at work over there
            "ck.pt.tmp.789": (now - 3600, True),  # train.py's older name, before this run
            "ck.pt.tmp.790": (now, False),
            "ck.pt.tmp.notes": (now - 3600, False),  # not a temporary file of ours
            f"other.pt.tmp.{host}.999999999": (now - 3600, False),  # another checkpoint's
        }
        for name, (written, _) in files.items():
            (tmp_path / name).write_bytes(b"partial")
            os.utime(tmp_path / name, (written, written))
        train.save_checkpoint(str(path), {"epoch": 1}, started=started)
        kept = sorted(name for name, (_, stale) in files.items() if not stale)
        assert sorted(os.listdir(tmp_path)) == sorted(["ck.pt", *kept])
        err = capsys.readouterr().err
        assert f"ck.pt.tmp.{host}.{live[0].pid} (pid {live[0].pid} on this host started after " \
               "the file was last written)" in err
        assert "ck.pt.tmp.other-host.example.123 (written by pid 123 on host other-host.example " \
               "before this run started)" in err
    finally:
        for process in live:
            process.kill()
            process.wait()


def test_a_stale_temp_file_that_cannot_be_removed_does_not_stop_the_save(tmp_path, capsys):
    # (A directory stands in for another user's file: unlink refuses it, even for root.)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stuck = tmp_path / f"ck.pt.tmp.{socket.gethostname()}.{gone.pid}"
    stuck.mkdir()
    load_train().save_checkpoint(str(tmp_path / "ck.pt"), {"epoch": 1})
    assert torch.load(tmp_path / "ck.pt", weights_only=True) == {"epoch": 1}
    assert f"could not remove the stale temporary checkpoint file {stuck} (its writer, pid " \
           f"{gone.pid} on this host, is gone): " in capsys.readouterr().err

"""Data-parallel training of a small CNN with SyncBatchNorm on scikit-learn's digits.

    COLLECTIVES_BACKEND=mpi mpiexec -n 4 python scripts/train.py --epochs 2 --check
    COLLECTIVES_BACKEND=torch torchrun --nproc_per_node 4 scripts/train.py --epochs 2 --check
    ... --device cuda          (one GPU per rank: local_rank % device_count)

The digits (1797 8x8 images, shipped inside scikit-learn: nothing is downloaded)
are split once into 1437 training and 360 test images. Rank r trains on its own
contiguous shard of the training images (shards differ by at most one image); each
epoch every rank shuffles its shard and takes ``--batch`` images per step.

Exactness over uneven shards: every rank runs the same number of steps per epoch
(enough for the largest shard), so the last steps may have fewer images, or none,
on some ranks. The global batch of a step is the concatenation, in rank order, of
the ranks' batches of that step, and its size N is known on every rank without
communication (the shard sizes are). Each rank's loss is the sum of its images'
cross-entropies divided by N, and DataParallel sums (``grad_reduction="sum"``) the
ranks' gradients: the result is exactly the gradient of the mean loss over the
global batch. With SyncBatchNorm normalizing over the global batch too, N ranks
compute what one process computes on the concatenated batches with plain BatchNorm.

``--check`` proves it: after training it trains (1) the same model on one process
with plain BatchNorm on the global batches and (2) the same distributed run with
per-rank (unsynced) BatchNorm, and prints the largest parameter and running-stat
differences of the SyncBN run and of the unsynced control against (1). It exits
with status 1 when the SyncBN run differs by more than ``--tolerance`` or the
control is not clearly worse (then the check cannot tell synced from unsynced).

Rank 0 shows progress, prints loss and accuracy per epoch and writes a checkpoint
after every epoch (to ``<checkpoint>.tmp.<host>.<pid>``, then ``os.replace``: a crash
never leaves a torn checkpoint; a writer killed mid-write leaves its temporary file, which
the next save removes once no writer can still be at work on it, see ``stale_temp_files``).
``--resume`` continues from it: rank 0 reads it and broadcasts its bytes, so the ranks
need no shared file system; a file that is missing, unreadable, empty, not a torch file
or not a checkpoint of this script is a SystemExit on every rank naming the file and
what is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from collectives.syncbn import convert_sync_batchnorm
from collectives.syncbn.data_parallel import DataParallel
from torch import nn

import collectives
from collectives.communicator import Communicator

TEST_IMAGES = 360  # of 1797: 1437 for training
_IMPORTED = time.time()
NORMS = ("sync", "local")


@dataclass(frozen=True)
class Config:
    epochs: int = 2
    batch: int = 32  # per rank
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    device: str = "cpu"
    check: bool = False
    tolerance: float = 1e-4
    checkpoint: str = "out/train_digits.pt"
    resume: bool = False
    steps_per_epoch: int | None = None  # None: as many as the largest shard needs
    train_images: int | None = None  # None: all 1437
    norm: str = "sync"  # "local": unsynced per-rank BatchNorm (the check then fails)
    progress: bool = True


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=Config.epochs)
    p.add_argument("--batch", type=int, default=Config.batch, help="images per rank per step")
    p.add_argument("--lr", type=float, default=Config.lr)
    p.add_argument("--momentum", type=float, default=Config.momentum)
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--device", choices=("cpu", "cuda"), default=Config.device)
    p.add_argument("--check", action="store_true",
                   help="compare with one-process BatchNorm on the global batch (exit 1 if off)")
    p.add_argument("--tolerance", type=float, default=Config.tolerance,
                   help="largest parameter/running-stat difference --check accepts")
    p.add_argument("--checkpoint", default=Config.checkpoint, help="written by rank 0 every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--steps-per-epoch", type=int, default=None,
                   help="stop each epoch after this many steps (short runs)")
    p.add_argument("--train-images", type=int, default=None,
                   help="train on the first N of the 1437 training images")
    p.add_argument("--norm", choices=NORMS, default=Config.norm,
                   help="sync: SyncBatchNorm; local: per-rank BatchNorm (a negative control)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    for name in ("epochs", "batch", "steps_per_epoch", "train_images"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    if args.train_images is not None and args.train_images > 1797 - TEST_IMAGES:
        p.error(f"--train-images must be <= {1797 - TEST_IMAGES}; got {args.train_images}")
    return Config(**vars(args))


# -- data -----------------------------------------------------------------------------------


@dataclass
class Digits:
    x_train: torch.Tensor  # (n, 1, 8, 8) float32 in [-1, 1]
    y_train: torch.Tensor  # (n,) int64
    x_test: torch.Tensor
    y_test: torch.Tensor


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as (images (1797, 8, 8) float64 in 0..16, labels (1797,) int64).

    Read straight from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``,
    what ``load_digits`` reads): importing scikit-learn costs each rank over a second.
    Falls back to ``sklearn.datasets.load_digits`` if the file is not where it used to be.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits  # noqa: PLC0415

    data = sklearn_digits()
    return data.images, data.target.astype(np.int64)


def load_digits(train_images: int | None = None) -> Digits:
    """scikit-learn's digits, split once (fixed seed, independent of --seed)."""
    images, labels = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    y = torch.from_numpy(labels)
    order = torch.from_numpy(np.random.default_rng(12345).permutation(len(y)))
    x, y = x[order], y[order]
    n_train = len(y) - TEST_IMAGES
    keep = n_train if train_images is None else train_images
    return Digits(x[:keep], y[:keep], x[n_train:], y[n_train:])


def shard(n: int, size: int, rank: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` items; the first ``n % size`` get one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def shard_sizes(n: int, size: int) -> list[int]:
    return [shard(n, size, r).stop - shard(n, size, r).start for r in range(size)]


def epoch_order(seed: int, epoch: int, rank: int, n: int) -> torch.Tensor:
    """The order in which rank ``rank`` visits its ``n`` images in ``epoch``."""
    return torch.from_numpy(np.random.default_rng([seed, epoch, rank]).permutation(n))


def steps_per_epoch(cfg: Config, sizes: list[int]) -> int:
    steps = math.ceil(max(sizes) / cfg.batch)
    return steps if cfg.steps_per_epoch is None else min(steps, cfg.steps_per_epoch)


def step_count(sizes: list[int], batch: int, step: int) -> int:
    """Images in the global batch of ``step``: every rank's share, known everywhere."""
    return sum(max(0, min(batch, n - step * batch)) for n in sizes)


# -- model ------------------------------------------------------------------------------------


def build_model(seed: int) -> nn.Module:
    """A small CNN for 8x8 images with plain BatchNorm2d; the same weights for one seed."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.MaxPool2d(2),  # 4x4
        nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


class MomentumSGD:
    """SGD with momentum, the update of ``torch.optim.SGD(params, lr, momentum)`` op for op.

    Written out because creating any ``torch.optim`` optimizer imports ``torch._dynamo``,
    over two seconds of CPU per rank: a quarter of the demo's time on two cores.
    ``torch.optim.SGD`` drops in unchanged (same ``step``/``zero_grad``/``state_dict``).
    """

    def __init__(self, params: Any, lr: float, momentum: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum = lr, momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            buf = self.buffers[i]
            if buf is None:
                buf = self.buffers[i] = torch.clone(p.grad).detach()
            else:
                buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "buffers": list(self.buffers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["buffers"]) != len(self.params):
            raise ValueError(f"optimizer state for {len(state['buffers'])} parameters; the model "
                             f"has {len(self.params)}")
        self.buffers = [None if b is None else b.to(p.device) for b, p in
                        zip(state["buffers"], self.params)]


def pick_device(cfg: Config, comm: Communicator) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch build or machine has no CUDA")
    device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


# -- checkpoints --------------------------------------------------------------------------------


#: What a checkpoint of this script holds (``--resume`` checks them before using any).
CHECKPOINT_KEYS = ("epoch", "world_size", "config", "model", "optimizer")
#: The settings a resumed run must share with the checkpoint (its shards and batches).
RESUME_KEYS = ("batch", "seed", "train_images", "steps_per_epoch")
#: Slack, in seconds, when comparing a process's start time with a file's modification time
#: (/proc gives the start in clock ticks after a boot time counted in whole seconds).
_CLOCK_SLACK = 2.0


def temp_path(path: str) -> str:
    """Where this process writes ``path``'s next version before renaming it into place:
    ``<path>.tmp.<host>.<pid>``, so a later run can tell whose it is (see ``stale_temp_files``)."""
    return f"{path}.tmp.{socket.gethostname()}.{os.getpid()}"


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def stale_temp_files(path: str, started: float) -> list[tuple[str, str]]:
    """The temporary files of ``path`` that no writer will finish, with why: ``(file, reason)``.

    A writer killed mid-checkpoint (SIGKILL, the node lost, out of memory) leaves its
    ``<path>.tmp.<host>.<pid>``. Another job may be writing the same path right now (two
    runs sharing a directory), so a file counts as stale only when its writer cannot be:
    on this host, when process ``pid`` is gone, is this process (which is not writing it
    now), or started after the file was last written (the pid was reused); from another
    host (whose processes cannot be seen from here) or with the older name ``<path>.tmp.<pid>``,
    when it was last written before ``started``, the start of the current run. Files of
    other checkpoints, and names that do not end in a pid, are never touched.
    """
    directory, base = os.path.split(os.path.abspath(path))
    prefix = base + ".tmp."
    host = socket.gethostname()
    stale = []
    for name in sorted(os.listdir(directory)):
        # <host>.<pid>, or <pid> alone (train.py before hosts were named: host unknown, "")
        writer_host, _, pid_text = name[len(prefix):].rpartition(".")
        if not name.startswith(prefix) or not pid_text.isdigit():
            continue
        full = os.path.join(directory, name)
        try:
            modified = os.stat(full).st_mtime
        except FileNotFoundError:  # its writer just renamed it into place
            continue
        pid = int(pid_text)
        if writer_host == host:
            if pid == os.getpid():
                reason = "left by an earlier write of this process"
            elif not _alive(pid):
                reason = f"its writer, pid {pid} on this host, is gone"
            elif (begun := _process_start(pid)) is not None and begun > modified + _CLOCK_SLACK:
                reason = f"pid {pid} on this host started after the file was last written"
            else:
                continue
        elif modified < started:
            where = f"host {writer_host}" if writer_host else "an unknown host"
            reason = f"written by pid {pid} on {where} before this run started"
        else:
            continue
        stale.append((full, reason))
    return stale


def save_checkpoint(path: str, state: dict[str, Any], *, started: float | None = None) -> None:
    """Write ``state`` to ``path`` atomically: a temporary file, then ``os.replace``.

    First removes the stale temporary files of ``path`` (``stale_temp_files``; ``started``:
    when the current run began, default this process's start), saying so on stderr.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if started is None:
        started = _process_start(os.getpid()) or _IMPORTED
    for stale, reason in stale_temp_files(path, started):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            continue
        except OSError as error:  # another user's file in a shared directory: not ours to fail on
            print(f"could not remove the stale temporary checkpoint file {stale} ({reason}): "
                  f"{error.strerror or error}", file=sys.stderr)
            continue
        print(f"removed the stale temporary checkpoint file {stale} ({reason})", file=sys.stderr)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # an exception or Ctrl-C mid-write: leave no temporary file
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _read_for_resume(path: str) -> tuple[bytes, str | None]:
    """``path``'s bytes, or why they cannot be a checkpoint (rank 0 only)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return b"", f"--resume: no checkpoint at {path} (no such file)"
    except OSError as error:
        return b"", f"--resume: cannot read the checkpoint {path}: {error.strerror or error}"
    if not data:
        return b"", (f"--resume: the checkpoint {path} is empty (0 bytes), not a checkpoint "
                     "(train.py renames a checkpoint into place only once it is written, so no "
                     "completed save left it); remove it or pass another --checkpoint")
    return data, None


def check_checkpoint(path: str, state: Any) -> dict[str, Any]:
    """``state`` if it is a checkpoint of this script, else SystemExit naming ``path`` and
    what it lacks."""
    def describe(value: Any) -> str:
        if isinstance(value, dict):
            keys = ", ".join(repr(k) for k in list(value)[:8]) + (", ..." if len(value) > 8 else "")
            return f"a dict with keys {keys}" if value else "an empty dict"
        return f"a {type(value).__module__}.{type(value).__name__}"

    what = "a torch file but not a checkpoint of scripts/train.py"
    if not isinstance(state, dict):
        raise SystemExit(f"--resume: {path} is {what}: it holds {describe(state)}")
    missing = [key for key in CHECKPOINT_KEYS if key not in state]
    if missing:
        raise SystemExit(f"--resume: {path} is {what}: it lacks {', '.join(map(repr, missing))} "
                         f"(it holds {describe(state)})")
    config = state["config"]
    lacking = [key for key in RESUME_KEYS if not isinstance(config, dict) or key not in config]
    if lacking:
        raise SystemExit(f"--resume: {path} is {what}: its 'config' lacks "
                         f"{', '.join(map(repr, lacking))} (it holds {describe(config)})")
    return state


def load_checkpoint(comm: Communicator, path: str) -> dict[str, Any]:
    """Rank 0 reads ``path``; its bytes reach every rank by broadcast (no shared disk needed).

    A file that cannot be our checkpoint (missing, unreadable, empty, not a torch file, a
    torch file of something else) is a SystemExit on every rank that names ``path`` and
    what is wrong; rank 0's reason travels to the others in place of the bytes.
    """
    header = np.zeros(2, dtype=np.int64)  # [0: bytes of the checkpoint, 1: of an error], length
    data = b""
    if comm.rank == 0:
        data, error = _read_for_resume(path)
        if error is not None:
            data = error.encode()
        header[:] = [0 if error is None else 1, len(data)]
    comm.broadcast(header, src=0)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if comm.rank == 0 \
        else np.empty(int(header[1]), dtype=np.uint8)
    comm.broadcast(buf, src=0)
    if header[0] == 1:
        raise SystemExit(buf.tobytes().decode())
    try:
        state = torch.load(io.BytesIO(buf.tobytes()), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - what torch.load raises for a bad file varies
        first = (str(error).strip().splitlines() or [""])[0][:200]
        raise SystemExit(f"--resume: {path} ({len(buf)} bytes) is not a torch checkpoint: "
                         f"torch.load raised {type(error).__name__}: {first}") from None
    return check_checkpoint(path, state)


# -- progress ---------------------------------------------------------------------------------


class Progress:
    """A progress bar on rank 0: tqdm when it is installed, else plain text."""

    def __init__(self, enabled: bool, total: int, label: str) -> None:
        self.enabled, self.total, self.label = enabled, total, label
        self.bar = None
        # Launchers pipe the ranks' output (isatty is False under mpiexec) but forward it to
        # the terminal as it comes, \r included: trust TERM there.
        self.tty = sys.stdout.isatty() or os.environ.get("TERM", "dumb") not in ("", "dumb")
        if enabled:
            try:
                from tqdm import tqdm  # noqa: PLC0415  (optional)

                self.bar = tqdm(total=total, desc=label, leave=False)
            except ImportError:
                pass

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")
        elif self.tty:
            width = 30
            done = width * step // self.total
            print(f"\r{self.label} [{'#' * done}{'.' * (width - done)}] {step}/{self.total} "
                  f"loss {loss:.4f}", end="", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.tty:
            print("\r" + " " * 79 + "\r", end="", flush=True)


# -- training ---------------------------------------------------------------------------------


def _sums(comm: Communicator, loss_sum: float, correct: int, count: int) -> tuple[float, float]:
    totals = comm.all_reduce(np.array([loss_sum, correct, count], dtype=np.float64), "sum")
    return totals[0] / max(totals[2], 1), totals[1] / max(totals[2], 1)


def evaluate(comm: Communicator, model: nn.Module, data: Digits, device: torch.device) -> tuple[float, float]:
    """Test loss and accuracy; each rank evaluates its shard (eval BN communicates nothing)."""
    part = shard(len(data.y_test), comm.size, comm.rank)
    x, y = data.x_test[part].to(device), data.y_test[part].to(device)
    model.eval()
    with torch.no_grad():
        logits = model(x) if len(y) else torch.zeros(0, 10, device=device)
        loss = nn.functional.cross_entropy(logits, y, reduction="sum").item() if len(y) else 0.0
        correct = int((logits.argmax(1) == y).sum().item())
    model.train()
    return _sums(comm, loss, correct, len(y))


def train(comm: Communicator, cfg: Config, data: Digits, norm: str, *, main_run: bool) -> nn.Module:
    """Train over ``comm`` with SyncBatchNorm (``norm="sync"``) or per-rank BatchNorm ("local").

    The main run shows progress, prints per-epoch metrics, checkpoints and resumes; a
    control run (``main_run=False``) only trains. Returns the trained module.
    """
    device = pick_device(cfg, comm)
    verbose = main_run and comm.rank == 0
    model = build_model(cfg.seed)
    if norm == "sync":
        model = convert_sync_batchnorm(model, comm=comm)
    model = model.to(device)
    optimizer = MomentumSGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    start_epoch = 0
    if main_run and cfg.resume:
        state = load_checkpoint(comm, cfg.checkpoint)
        for key in RESUME_KEYS:
            if state["config"][key] != getattr(cfg, key):
                raise SystemExit(f"--resume: the checkpoint was made with {key}="
                                 f"{state['config'][key]}, this run has {getattr(cfg, key)}")
        if state["world_size"] != comm.size:
            raise SystemExit(f"--resume: the checkpoint was made on {state['world_size']} ranks "
                             f"(their shards), this run has {comm.size}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        if verbose:
            print(f"resumed from {cfg.checkpoint} after epoch {start_epoch}")
    # grad_reduction="sum": each rank's loss is already divided by the global batch size.
    ddp = DataParallel(model, comm, grad_reduction="sum")

    sizes = shard_sizes(len(data.y_train), comm.size)
    mine = shard(len(data.y_train), comm.size, comm.rank)
    x_shard, y_shard = data.x_train[mine].to(device), data.y_train[mine].to(device)
    steps = steps_per_epoch(cfg, sizes)
    for epoch in range(start_epoch, cfg.epochs):
        began = time.perf_counter()
        order = epoch_order(cfg.seed, epoch, comm.rank, len(y_shard)).to(device)
        progress = Progress(verbose and cfg.progress, steps, f"epoch {epoch + 1}/{cfg.epochs}")
        loss_sum, correct, seen = 0.0, 0, 0
        for step in range(steps):
            idx = order[step * cfg.batch:(step + 1) * cfg.batch]
            x, y = x_shard[idx], y_shard[idx]
            logits = ddp(x)
            local_sum = nn.functional.cross_entropy(logits, y, reduction="sum")
            loss = local_sum / step_count(sizes, cfg.batch, step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # gradients are summed over ranks when this returns
            optimizer.step()
            if main_run:
                loss_sum += local_sum.item()
                correct += int((logits.argmax(1) == y).sum().item())
                seen += len(y)
                progress.update(step + 1, local_sum.item() / max(len(y), 1))
        progress.close()
        if not main_run:
            continue
        train_loss, train_acc = _sums(comm, loss_sum, correct, seen)
        test_loss, test_acc = evaluate(comm, model, data, device)
        if comm.rank == 0:
            save_checkpoint(cfg.checkpoint, {
                "epoch": epoch + 1, "world_size": comm.size, "config": asdict(cfg),
                "model": model.state_dict(), "optimizer": optimizer.state_dict()})
        if verbose:
            print(f"epoch {epoch + 1}/{cfg.epochs}: train loss {train_loss:.4f} acc "
                  f"{100 * train_acc:5.1f}%   test loss {test_loss:.4f} acc {100 * test_acc:5.1f}%   "
                  f"({steps} steps, {time.perf_counter() - began:.1f} s)", flush=True)
    ddp.remove_hooks()
    return model


def train_reference(cfg: Config, data: Digits, size: int, device: torch.device) -> nn.Module:
    """One process, plain BatchNorm, the global batches: what ``size`` SyncBN ranks must equal."""
    model = build_model(cfg.seed).to(device)
    optimizer = MomentumSGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    sizes = shard_sizes(len(data.y_train), size)
    shards = [shard(len(data.y_train), size, r) for r in range(size)]
    x_all, y_all = data.x_train.to(device), data.y_train.to(device)
    steps = steps_per_epoch(cfg, sizes)
    for epoch in range(cfg.epochs):
        orders = [epoch_order(cfg.seed, epoch, r, sizes[r]).to(device) for r in range(size)]
        for step in range(steps):
            rows = torch.cat([orders[r][step * cfg.batch:(step + 1) * cfg.batch] + shards[r].start
                              for r in range(size)])
            loss = nn.functional.cross_entropy(model(x_all[rows]), y_all[rows])  # global mean
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model


# -- the equivalence check ------------------------------------------------------------------------


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1).cpu() for t in tensors])


def _params(model: nn.Module) -> torch.Tensor:
    return _flat(list(model.parameters()))


def _running_stats(model: nn.Module) -> torch.Tensor:
    return _flat([b for name, b in model.named_buffers() if name.endswith(("running_mean", "running_var"))])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().item())


def rank_disagreement(comm: Communicator, model: nn.Module) -> float:
    """Largest difference between any rank's parameters and buffers and rank 0's."""
    mine = torch.cat([_params(model), _running_stats(model)]).numpy()
    rank0 = comm.broadcast(mine.copy(), src=0)
    return float(comm.all_reduce(np.array([np.abs(mine - rank0).max()]), "max")[0])


def run(comm: Communicator, cfg: Config) -> dict[str, Any]:
    """Train (and check, with ``cfg.check``); the same summary dict on every rank."""
    data = load_digits(cfg.train_images)
    if comm.rank == 0 and cfg.progress:
        sizes = shard_sizes(len(data.y_train), comm.size)
        print(f"training on {comm.size} rank(s), backend {comm.backend}, device {cfg.device}: "
              f"{len(data.y_train)} images in shards of {min(sizes)}-{max(sizes)}, batch "
              f"{cfg.batch} per rank, {steps_per_epoch(cfg, sizes)} steps per epoch, "
              f"{'SyncBatchNorm' if cfg.norm == 'sync' else 'per-rank BatchNorm'}", flush=True)
    model = train(comm, cfg, data, cfg.norm, main_run=True)
    summary: dict[str, Any] = {"params": _params(model).numpy(),
                               "running_stats": _running_stats(model).numpy(),
                               "ranks_disagree": rank_disagreement(comm, model)}
    if not cfg.check:
        return summary
    control = train(comm, cfg, data, "local" if cfg.norm == "sync" else "sync", main_run=False)
    if cfg.norm != "sync":
        model, control = control, model  # --norm local: the "main" run is the control
    numbers = np.zeros(4, dtype=np.float64)
    if comm.rank == 0:
        reference = train_reference(cfg, data, comm.size, pick_device(cfg, comm))
        ref_params, ref_stats = _params(reference), _running_stats(reference)
        numbers[:] = [_max_diff(_params(model), ref_params), _max_diff(_running_stats(model), ref_stats),
                      _max_diff(_params(control), ref_params), _max_diff(_running_stats(control), ref_stats)]
    comm.broadcast(numbers, src=0)
    sync_param, sync_stat, control_param, control_stat = (float(v) for v in numbers)
    sync_worst, control_worst = max(sync_param, sync_stat), max(control_param, control_stat)
    synced_ok = sync_worst <= cfg.tolerance
    # One rank has nothing to synchronize: the control then equals the reference.
    control_ok = comm.size == 1 or control_worst > 10 * max(sync_worst, cfg.tolerance)
    main_ok = synced_ok and control_ok and cfg.norm == "sync"
    summary.update(sync_param_diff=sync_param, sync_stat_diff=sync_stat,
                   control_param_diff=control_param, control_stat_diff=control_stat,
                   ok=main_ok)
    if comm.rank == 0:
        print(f"equivalence check: {comm.size} ranks vs one process on the global batch "
              f"(float32, {cfg.epochs} epoch(s))")
        print(f"  {'':34}{'max |param diff|':>18}{'max |running-stat diff|':>26}")
        print(f"  {'SyncBatchNorm (synced)':34}{sync_param:>18.2e}{sync_stat:>26.2e}   "
              f"{'OK' if synced_ok else 'FAIL'} (tolerance {cfg.tolerance:.0e})")
        print(f"  {'per-rank BatchNorm (control)':34}{control_param:>18.2e}{control_stat:>26.2e}   "
              f"{'much larger, as expected' if control_ok and comm.size > 1 else ''}"
              f"{'' if control_ok else 'NOT larger: the check cannot tell'}")
        print(f"  ranks agree on the trained model to {summary['ranks_disagree']:.1e}")
        if cfg.norm != "sync":
            print("SyncBN check FAILED: trained with --norm local (per-rank BatchNorm)")
        else:
            print("SyncBN check passed" if main_ok else "SyncBN check FAILED", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    comm = collectives.init()
    summary = run(comm, cfg)
    return 0 if summary.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())

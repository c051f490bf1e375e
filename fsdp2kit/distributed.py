"""Process-group setup: the same code under `--nproc`, `torchrun` (multi-node included) or a plain single process."""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import re
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# Imported before any process group exists: this module binds `group.WORLD` as its functions' default argument when
# imported, and `torch._dynamo` and FSDP import it. Imported later, it would hold the default group after
# `destroy_process_group`, its gloo and TCPStore threads alive into interpreter exit, where their teardown can abort
# the process ("terminate called without an active exception") after a run has reported its result.
import torch.distributed.nn.functional  # noqa: F401

from fsdp2kit.errors import RunFault, UserError

# The oldest torch the whole test suite was run on (its failures there: torch's own output, its memory tracker; see
# README). Before it a run fails with a traceback: 2.9 at its end (a DTensor cache `destroy_process_group` clears
# came in 2.10), 2.6 at the first fully_shard (no ignored_params).
OLDEST_TORCH = (2, 10)
# The oldest transformers the whole suite runs on (`make test-floor`): ROLL's pin. 5.0 and 5.1 were never run; 4.x
# lacks the weight-conversion machinery (`transformers.core_model_loading`) that loading and export use.
OLDEST_TRANSFORMERS = (5, 2)


def _release(version: str) -> tuple[int, ...] | None:
    """(major, minor) of a version: "2.11.0+cu130", "2.12.0.dev20260101", "5.25.0.dev0": (2, 11), (2, 12), (5, 25)."""
    release = re.match(r"(\d+)\.(\d+)", version)
    return None if release is None else tuple(map(int, release.groups()))


def require_supported_versions() -> None:
    """One line, before any process group exists, where the installed torch or transformers is older than the
    oldest the suite runs on (OLDEST_TORCH, OLDEST_TRANSFORMERS)."""
    import transformers

    for package, version, oldest_release in (
        ("torch", torch.__version__, OLDEST_TORCH),
        ("transformers", transformers.__version__, OLDEST_TRANSFORMERS),
    ):
        release = _release(version)
        if release is not None and release < oldest_release:
            oldest = ".".join(map(str, oldest_release))
            raise UserError(
                f"fsdp2kit needs {package} {oldest} or newer (this is {package} {version}): "
                f"pip install '{package}>={oldest}'"
            )


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_ALLOCATOR = {"reusing": False}  # whether this process's heap is in the steps' mode (reuse_freed_memory)


def _glibc() -> ctypes.CDLL | None:
    """glibc, whose malloc holds a CPU rank's tensors (None elsewhere, e.g. macOS: nothing to tune or count)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _mallopt(settings: dict[int, int], trim: bool = False) -> None:
    libc = _glibc()
    if libc is None:
        return
    for parameter, value in settings.items():
        libc.mallopt(parameter, value)
    if trim:
        libc.malloc_trim(0)


def return_large_frees_to_os(threshold_bytes: int = 4 << 20) -> None:
    """On CPU, tensors live in glibc's heap. Its default raises the mmap threshold after each large free, so freed
    buffers of one-off work (loading, exporting: each tensor a new size) stay in the heap and the process's memory
    only grows (a load showed 3.2x what is live). A fixed threshold maps large buffers separately and unmaps them
    when freed; what the heap holds free is given back."""
    _ALLOCATOR["reusing"] = False
    _mallopt({_M_MMAP_THRESHOLD: threshold_bytes, _M_TRIM_THRESHOLD: 128 << 10}, trim=True)


def share_one_heap() -> None:
    """On a CPU rank with peers (`WORLD_SIZE` > 1), before the process group's threads first allocate: glibc gives
    each thread that allocates an arena of its own (up to 8 per core), and one arena's free memory serves no other
    thread, so gloo's threads' buffers sat in heaps of their own beside the steps' (the 2-rank peak of the Trainer
    comparison, medians of 14 and 8 launches: 1040 -> 1012 MiB, CPU time unchanged; docs/PERFORMANCE.md). Not alone:
    one rank's collectives move nothing, and there one arena cost 3.5% of the step and saved no memory."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _mallopt({_M_ARENA_MAX: 1})


def malloc_heaps() -> int | None:
    """How many heaps glibc's malloc holds (malloc_info's), what `share_one_heap` keeps to one (None: not glibc)."""
    libc = _glibc()
    if libc is None:
        return None
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile(suffix=".xml") as report:
        stream = libc.fopen(report.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        return Path(report.name).read_text().count("<heap nr=")


def reuse_freed_memory(device: torch.device) -> None:
    """Steps allocate the same buffers every time: on CPU, keep freed memory in the heap for the next step (buffers
    up to 32 MiB from the heap, up to 1 GiB free kept), as CUDA's caching allocator keeps its blocks. Returning it
    made the kernel fault every large buffer's pages in again each step (260k page faults per step at 2 ranks of
    the 25M benchmark model, 13% of the step: docs/PERFORMANCE.md; trimming the heap's top above glibc's 64 MiB
    still cost 5-10% of the Trainer comparison's step). Called by every step; cheap once set."""
    if device.type == "cpu" and not _ALLOCATOR["reusing"]:
        _ALLOCATOR["reusing"] = True
        _mallopt({_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 1 << 30})


@contextmanager
def returning_freed_memory(device: torch.device) -> Iterator[None]:
    """One-off work between steps (loading a checkpoint, an export): large buffers given back to the OS and the
    heap's free memory released, then the steps' reuse again if it was on."""
    reusing = _ALLOCATOR["reusing"]
    if device.type == "cpu":
        return_large_frees_to_os()
    try:
        yield
    finally:
        if reusing:
            reuse_freed_memory(device)


_ENVIRONMENT_BEFORE: dict[str, str | None] = {}  # what init_distributed replaced to run without a launcher


COLLECTIVE_TIMEOUT_ENV = "FSDP2KIT_COLLECTIVE_TIMEOUT_S"


def collective_timeout() -> timedelta | None:
    """How long a collective may wait for the other ranks before it fails (FSDP2KIT_COLLECTIVE_TIMEOUT_S; default
    torch's, 30 minutes for gloo): a rank stuck in a collective that no other rank will join is then reported
    instead of waiting out the job."""
    value = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise UserError(f"{COLLECTIVE_TIMEOUT_ENV}={value!r}: give a number of seconds > 0")
    return timedelta(seconds=seconds)


def init_distributed(device_mapping: list[int] | None) -> Runtime:
    """NCCL on CUDA (gloo kept for CPU tensors), gloo on CPU. Without a launcher, a world of one."""
    require_supported_versions()
    if "RANK" not in os.environ:
        world = dict(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
        _ENVIRONMENT_BEFORE.update({name: os.environ.get(name) for name in world})
        os.environ.update(world)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_mapping is not None and len(device_mapping) != world_size:
        raise UserError(
            f"device_mapping lists {len(device_mapping)} devices but the job has {world_size} ranks; "
            f"give {world_size} device ids or launch {len(device_mapping)} ranks"
        )
    if torch.cuda.is_available():
        index = device_mapping[rank] % torch.cuda.device_count() if device_mapping else local_rank
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        share_one_heap()
        return_large_frees_to_os()
    if not dist.is_initialized():
        # Under `torchrun --max-restarts`, every attempt meets in the same store: keys of the attempt before (a dead
        # rank's address) would be read by a fast rank of this one. A prefix per attempt keeps them apart.
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"fsdp2kit/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=collective_timeout(),
        )
        atexit.unregister(_end_at_exit)  # once, however many groups this process makes in turn
        atexit.register(_end_at_exit)
    return Runtime(rank, world_size, local_rank, device)


def _end_at_exit() -> None:
    """A script that never calls `shutdown` (an API caller's, a test's worker) leaves the group to the interpreter's
    teardown, which destroys its C++ threads while joinable: "terminate called without an active exception",
    SIGABRT, now and then after a finished run. Ended here first, while the interpreter is whole; the run's
    cyclic garbage (the model, its meshes) is collected first, as it holds the group."""
    gc.collect()
    shutdown()


_ALLOCATION = re.compile(r"[Tt]ried to allocate ([0-9.]+ ?[KMGT]?i?B|\d+ bytes)")


def out_of_memory_message(exc: BaseException, runtime: Runtime) -> str | None:
    """One sentence for an allocation failure (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, Python's
    MemoryError): which rank, how much it asked for, and what to lower. None for any other error."""
    text = str(exc)
    if not (
        isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    ):
        return None
    match = _ALLOCATION.search(text)
    asked = ""
    if match:
        amount = match.group(1)
        if amount.endswith(" bytes"):  # the CPU allocator counts bytes
            amount = f"{int(amount.split()[0]) / 2**30:.2f} GiB"
        asked = f" allocating {amount}"
    return (
        f"out of memory on rank {runtime.rank} ({runtime.device}){asked}: lower "
        "training.per_device_train_batch_size or data.seq_len, or set model.gradient_checkpointing: true or "
        "strategy_args.strategy_config.offload_policy: true"
    )


def shutdown() -> None:
    """End the process group, and put back the environment the world of one replaced: left there, it would make the
    next run in this process (a notebook) or a launcher started from it think it is rank 0 of a launched job."""
    if dist.is_initialized():
        destroy_process_group()
    for name, value in _ENVIRONMENT_BEFORE.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _ENVIRONMENT_BEFORE.clear()


def destroy_process_group() -> None:
    """Destroy the default process group and forget what DTensor cached about its meshes. The sharding caches compare
    device meshes without their rank, so after a process group of another rank in the same process (`plan`'s fake
    rank 0, a test's fake rank 1) a cached result would hand new DTensors the old mesh, and with it the old rank's
    shard (Megatron-LM met the same after re-creating its groups: NVIDIA/Megatron-LM#7029). The topology and
    redistribution caches hold the meshes themselves, and through them the group and its threads."""
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_fast_path_sharding_prop_cache, _clear_python_sharding_prop_cache

    dist.destroy_process_group()
    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


# How gloo and NCCL report a peer that went away (its sockets closed by the kernel when the process died), and a
# collective that no other rank joined in time.
_LOST_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|NCCL communicator was aborted")
_TIMED_OUT = re.compile(r"Timed out waiting|timed out|Watchdog caught collective operation timeout")


def lost_peer_message(exc: BaseException, runtime: Runtime) -> str | None:
    """One sentence for a collective that failed because another rank is gone (killed, crashed) or never joined it
    within the collective timeout; None for any other error."""
    if not isinstance(exc, dist.DistError | RuntimeError):
        return None
    text = str(exc)
    if _LOST_PEER.search(text):
        what = "lost its connection to another rank of the job (it died or was killed) during a collective"
    elif _TIMED_OUT.search(text):
        what = f"timed out in a collective that another rank did not join ({COLLECTIVE_TIMEOUT_ENV})"
    else:
        return None
    return f"rank {runtime.rank} {what}; the newest complete checkpoint is intact and the same command resumes from it"


@contextmanager
def failing_together(what: str) -> Iterator[None]:
    """A rank-local part of a collective operation (a collective itself: every rank enters it): an error on any rank
    is raised on every rank, rather than leaving the others waiting for it in the next collective until the
    collective timeout. The failing rank raises its own error; the others a RunFault naming it."""
    error: Exception | None = None
    try:
        yield
    except Exception as exc:
        error = exc
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        rank, report = failed[0]
        raise RunFault(f"{what} failed on rank {rank} ({report}); every rank stopped with it")


def watch_parent(interval_s: float = 1.0) -> None:
    """A rank whose launcher died (SIGKILL of `fsdp2kit train --nproc`, of torchrun's agent) sends itself SIGTERM:
    it stops at the next step boundary and releases output_dir's lock, instead of training on, orphaned."""
    import signal
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="fsdp2kit-parent-watch", daemon=True).start()

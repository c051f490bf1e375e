"""`convert` into a destination it cannot fill (issue 34's fourth pass): a read-only or full disk, or a path under
a file, is one sentence and leaves nothing behind, never a partial folder and a traceback."""

from __future__ import annotations

import errno
import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import make_hf_folder

from fsdp2kit.checkpoint.convert import convert
from fsdp2kit.cli import main
from fsdp2kit.errors import RunFault, UserError
from fsdp2kit.models import export


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("convert")
    make_hf_folder(root / "hf", "tiny-llama", layers=1)
    convert(root / "hf", root / "dcp", "dcp")
    return root / "dcp"


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_convert_where_no_folder_can_be_made_is_one_sentence(dcp_checkpoint, tmp_path, where):
    (tmp_path / "a_file").write_text("mine")
    dst = tmp_path / "a_file" / "out" if where == "under_a_file" else Path("/proc/fsdp2kit-convert")
    reason = "Not a directory" if where == "under_a_file" else "No such file or directory"
    with pytest.raises(UserError, match=f"convert: '{dst}' cannot be written \\({reason}\\); nothing was left there"):
        convert(dcp_checkpoint, dst, "hf")
    assert (tmp_path / "a_file").read_text() == "mine"


def test_convert_onto_a_full_disk_is_one_sentence_and_leaves_nothing(dcp_checkpoint, tmp_path, monkeypatch):
    """The disk fills as the last shard is written: ENOSPC as the kernel reports it to the writer."""
    close = export.SafetensorsWriter.close

    def filling(writer):
        close(writer)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export.SafetensorsWriter, "close", filling)
    (tmp_path / "given").mkdir()
    for dst in (tmp_path / "new", tmp_path / "given"):  # a folder it makes, and an empty one it was given
        with pytest.raises(RunFault, match=f"no space left on device: convert --to hf in '{dst}' needs about"):
            convert(dcp_checkpoint, dst, "hf")
    assert not (tmp_path / "new").exists() and not any((tmp_path / "given").iterdir())


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail with EFBIG from the kernel (SIGXFSZ, which would kill the process, ignored),
    within the block; only the soft limit is lowered, so it is raised back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_convert_that_the_kernel_stops_writing_is_one_line_and_leaves_nothing(dcp_checkpoint, tmp_path, capsys):
    """A real failed write (a file-size limit: EFBIG from the kernel mid-file) through the command line."""
    dst = tmp_path / "hf"
    with file_size_limit(256 << 10):
        code = main(["convert", str(dcp_checkpoint), str(dst), "--to", "hf"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and errors == [
        f"error: convert: '{dst}' cannot be written (File too large); nothing was left there"
    ]
    assert not dst.exists()


def test_a_full_disk_message_shows_that_the_need_exceeds_the_free_space(tmp_path, monkeypatch):
    """It said "needs about 1.4 MiB and its disk has 1.4 MiB free": now as many decimals as tell them apart."""
    from fsdp2kit import durable

    for needed, free, shown in [
        (int(1.44 * 2**20), int(1.41 * 2**20), "needs about 1.44 MiB and its disk has 1.41 MiB free"),
        (int(1.4 * 2**20) + 100, int(1.4 * 2**20), "needs about 1,468,106 bytes and its disk has 1,468,006 bytes free"),
        (3 * 2**20, 2**20, "needs about 3.0 MiB and its disk has 1.0 MiB free"),
    ]:
        monkeypatch.setattr(durable, "free_bytes", lambda path, free=free: free)
        assert shown in durable.disk_full_message(tmp_path, "the HF folder", needed, "the checkpoints are intact")

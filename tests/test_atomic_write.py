"""`atomic_write`: whole files, replaced by rename, never written through a planted link."""

import os
import stat

import pytest

from lowbit._atomic import LinkedPathError, atomic_write


def _plant(link, victim):
    victim.write_bytes(b"keep")
    os.symlink(victim, link)


def test_writes_bytes_or_a_writer_and_leaves_no_temporary(tmp_path):
    atomic_write(tmp_path / "a.json", b"{}")
    atomic_write(tmp_path / "b.bin", lambda f: f.write(b"xy"))
    # A writer may close the file it is given, and may read back what it wrote.
    atomic_write(tmp_path / "c.bin", lambda f: (f.write(b"z"), f.seek(0), f.read(), f.close()))
    assert (tmp_path / "a.json").read_bytes() == b"{}"
    assert (tmp_path / "b.bin").read_bytes() == b"xy"
    assert (tmp_path / "c.bin").read_bytes() == b"z"
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.bin", "c.bin"]


def test_replaces_an_existing_file_with_the_modes_of_a_plain_open(tmp_path):
    target = tmp_path / "a.json"
    target.write_bytes(b"old")
    old_umask = os.umask(0o027)
    try:
        atomic_write(target, b"new")
    finally:
        os.umask(old_umask)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_link_at_the_target_is_refused_naming_it_and_the_fix(tmp_path):
    victim = tmp_path / "victim"
    _plant(tmp_path / "eval.json", victim)
    with pytest.raises(LinkedPathError, match=r"'.*eval.json'.*symbolic link.*Remove the link"):
        atomic_write(tmp_path / "eval.json", b"{}")
    assert victim.read_bytes() == b"keep"
    assert sorted(os.listdir(tmp_path)) == ["eval.json", "victim"]


def test_a_dangling_link_at_the_target_creates_nothing_through_it(tmp_path):
    os.symlink(tmp_path / "elsewhere", tmp_path / "out.png")
    with pytest.raises(LinkedPathError):
        atomic_write(tmp_path / "out.png", b"png")
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("name", ["eval.json.tmp", ".eval.json.tmp", "eval.tmp"])
def test_links_at_the_old_temporary_names_are_not_followed(tmp_path, name):
    victim = tmp_path / "victim"
    _plant(tmp_path / name, victim)
    atomic_write(tmp_path / "eval.json", b"{}")
    assert victim.read_bytes() == b"keep"
    assert (tmp_path / "eval.json").read_bytes() == b"{}"
    assert not (tmp_path / "eval.json").is_symlink()


def test_a_link_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    # The name is random, but even one guessed right is created with O_EXCL | O_NOFOLLOW.
    from lowbit import _atomic

    tokens = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(_atomic.secrets, "token_hex", lambda n: next(tokens))
    victim = tmp_path / "victim"
    _plant(tmp_path / f".a.json.{'0' * 16}.tmp", victim)
    atomic_write(tmp_path / "a.json", b"{}")
    assert victim.read_bytes() == b"keep"
    assert (tmp_path / "a.json").read_bytes() == b"{}"


def test_a_linked_directory_below_the_trusted_one_is_refused(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", checkpoint / "plots")
    with pytest.raises(LinkedPathError, match="plots', a directory on its way"):
        atomic_write(checkpoint / "plots" / "a.png", b"png", within=checkpoint)
    assert os.listdir(tmp_path / "outside") == []
    # The trusted directory itself may be a link the user made (``latest -> run1``).
    os.symlink(checkpoint, tmp_path / "latest")
    (checkpoint / "real").mkdir()
    atomic_write(tmp_path / "latest" / "real" / "a.png", b"png", within=tmp_path / "latest")
    assert (checkpoint / "real" / "a.png").read_bytes() == b"png"
    with pytest.raises(ValueError, match="is not inside"):
        atomic_write(tmp_path / "a.png", b"png", within=checkpoint)


def test_a_failing_writer_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    target.write_bytes(b"old")

    def broken(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["report.json"]


def test_a_directory_at_the_target_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory"):
        atomic_write(tmp_path / "d", b"x")

"""Issue 21: one run per output_dir (a lock; overwriting moves the earlier run aside), checkpoint manifests (a damaged
file is found and named), fsync before and after the rename, disk full, and a run whose first save never completed
starts again instead of being stuck."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from trainer import sft
from trainer.loop import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[3]
FEW_STEPS = [
    "--model",
    "tiny",
    "--max_steps",
    "4",
    "--save_steps",
    "2",
    "--per_device_train_batch_size",
    "8",
    "--exact_match_examples",
    "0",
    "--logging_steps",
    "1",
    "--disable_tqdm",
    "true",
]


def _save(out, step, payload=b"weights" * 100):
    def save_model(directory):
        (directory / "model.safetensors").write_bytes(payload)

    return ckpt.save_checkpoint(
        out,
        step,
        save_model=save_model,
        data_state={"position": step},
        trainer_state={"global_step": step},
        args_dict={"lr": 1e-3},
    )


def test_manifest_lists_every_file_and_an_intact_checkpoint_verifies(tmp_path):
    path = _save(tmp_path, 2)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {ckpt.MANIFEST}
    assert set(manifest) == on_disk and "trainer_state.json" in manifest and "rng_state.pth" in manifest
    assert manifest["model.safetensors"]["size"] == 700
    assert ckpt.verify_checkpoint(path) is None


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: p.joinpath("model.safetensors").write_bytes(b"weights" * 50), "350 bytes, 700 when saved"),
        (lambda p: p.joinpath("model.safetensors").write_bytes(b"garbage" * 100), "CRC-32 mismatch"),
        (lambda p: p.joinpath("rng_state.pth").write_bytes(b""), "0 bytes"),
        (lambda p: p.joinpath("data_state.json").unlink(), "missing"),
        (lambda p: p.joinpath(ckpt.MANIFEST).write_text("{not json"), "unreadable"),
    ],
)
def test_a_damaged_file_is_named(tmp_path, damage, expected):
    path = _save(tmp_path, 2)
    damage(path)
    problem = ckpt.verify_checkpoint(path)
    assert problem is not None and expected in problem
    assert str(path) in problem  # names the file (or the manifest) in the checkpoint


def test_auto_skips_a_damaged_newest_checkpoint_and_a_path_to_it_is_refused(tmp_path):
    _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    (newest / "model.safetensors").write_bytes(b"w")
    said = []
    assert ckpt.resolve_resume("auto", tmp_path, say=said.append) == tmp_path / "checkpoint-2"
    assert len(said) == 1 and "skipping checkpoint-4" in said[0] and "model.safetensors" in said[0]
    with pytest.raises(ckpt.CheckpointError, match="checkpoint-4 is damaged .*model.safetensors"):
        ckpt.resolve_resume(str(newest), tmp_path)


def test_auto_without_a_complete_checkpoint_starts_from_step_0(tmp_path):
    (tmp_path / "checkpoint-2.tmp").mkdir()  # a first save that was killed
    said = []
    assert ckpt.resolve_resume("auto", tmp_path, say=said.append) is None
    assert said == [f"resume_from_checkpoint auto: no complete checkpoint in {tmp_path}; starting from step 0"]


def test_a_checkpoint_without_manifest_is_taken_as_it_is(tmp_path):
    path = _save(tmp_path, 2)
    (path / ckpt.MANIFEST).unlink()  # written before manifests existed
    assert ckpt.verify_checkpoint(path) is None


def test_every_file_and_both_directories_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = _save(tmp_path, 2)
    tmp = str(tmp_path / "checkpoint-2.tmp")
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert {f"{tmp}/{name}" for name in files} <= set(synced)  # every file, the manifest included, before the rename
    assert tmp in synced  # the checkpoint's own directory entries
    assert synced[-1] == str(tmp_path)  # the rename, last


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.fixture(scope="module")
def run_with_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "out"
    with kernels.backend("reference"):
        assert sft.main([*FEW_STEPS, "--output_dir", str(out)]) == 0
    return out


def test_cli_resume_auto_skips_the_damaged_checkpoint_and_a_damaged_path_exits_2(run_with_checkpoints, capsys):
    out = run_with_checkpoints
    assert [p.name for p in ckpt.checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    weights = out / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    capsys.readouterr()
    assert sft.main([*FEW_STEPS, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-4")]) == 2
    line = _one_line_error(capsys)
    assert "checkpoint-4 is damaged" in line and "model.safetensors" in line
    assert sft.main([*FEW_STEPS, "--output_dir", str(out), "--resume_from_checkpoint", "auto"]) == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint-4, it is damaged" in err and "Traceback" not in err
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and ckpt.verify_checkpoint(out / "checkpoint-4") is None  # saved again, whole


def test_cli_a_first_save_killed_leaves_a_run_that_the_same_command_restarts(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-2.tmp").mkdir(parents=True)  # SIGKILL during the first save leaves only this
    with kernels.backend("reference"):
        assert sft.main([*FEW_STEPS, "--max_steps", "2", "--output_dir", str(out)]) == 0
        assert [p.name for p in ckpt.checkpoints(out)] == ["checkpoint-2"]
        assert (
            sft.main(
                [
                    *FEW_STEPS,
                    "--max_steps",
                    "2",
                    "--output_dir",
                    str(tmp_path / "o2"),
                    "--resume_from_checkpoint",
                    "auto",
                ]
            )
            == 0
        )
    assert "no complete checkpoint" in capsys.readouterr().err


class _FullDisk:
    """torch.save that fills the disk half way through a file (as torch reports it: "unexpected pos"), and a
    shutil.disk_usage that reports the device full from then on."""

    def __init__(self, monkeypatch, when="optimizer.pt"):
        self.full = False
        real_save, real_usage = ckpt.torch.save, ckpt.shutil.disk_usage

        def save(obj, file, *a, **k):
            if when in str(file):
                self.full = True
                open(file, "wb").write(b"\0" * 4096)
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing "
                    "file data/0: file write failed; unexpected pos 14038400 vs 14038292"
                )
            return real_save(obj, file, *a, **k)

        def usage(path):
            total, used, free = real_usage(path)
            return type(real_usage(path))(total, used, 1 << 20 if self.full else free)

        monkeypatch.setattr(ckpt.torch, "save", save)
        monkeypatch.setattr(ckpt.shutil, "disk_usage", usage)


def test_disk_full_during_a_save_removes_the_partial_copy_and_says_so(tmp_path, monkeypatch):
    earlier = _save(tmp_path, 2)
    _FullDisk(monkeypatch, when="rng_state")
    with pytest.raises(
        ckpt.OutOfSpaceError,
        match=r"out of space: checkpoint-4 needs more than the \d+ bytes written .*\(1\.0 MB free\)",
    ):
        _save(tmp_path, 4)
    assert not (tmp_path / "checkpoint-4.tmp").exists() and not (tmp_path / "checkpoint-4").exists()
    assert ckpt.verify_checkpoint(earlier) is None


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    _save(tmp_path, 2, payload=b"w" * (3 << 20))
    disk = _FullDisk(monkeypatch)
    disk.full = True  # 1 MB free, the last checkpoint holds 3 MB
    with pytest.raises(ckpt.OutOfSpaceError, match=r"checkpoint-4: it needs about 3\.2 MB .* 1\.0 MB free"):
        _save(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_cli_disk_full_is_one_line_with_the_resume_command_and_exit_1(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    _FullDisk(monkeypatch, when="checkpoint-4.tmp/optimizer.pt")
    with kernels.backend("reference"):
        assert sft.main([*FEW_STEPS, "--output_dir", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-2].startswith("error: the device of") and "out of space" in err[-2] and "1.0 MB free" in err[-2]
    assert err[-1].strip().endswith("--resume_from_checkpoint auto")
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    assert ckpt.verify_checkpoint(out / "checkpoint-2") is None


def test_overwrite_moves_the_earlier_run_aside_so_its_checkpoints_never_outrank_this_runs(tmp_path, capsys):
    """Issue 21 item 1: the old checkpoint-15/20 used to stay 'newest', and rotation deleted the new run's."""
    out = tmp_path / "out"
    for step in (15, 20):
        _save(out, step)
    (out / "model.safetensors").write_bytes(b"old model")
    (out / "final_metrics.json").write_text("{}\n")
    with kernels.backend("reference"):
        assert (
            sft.main([*FEW_STEPS, "--output_dir", str(out), "--overwrite_output_dir", "--save_total_limit", "2"]) == 0
        )
    assert [p.name for p in ckpt.checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert (out / "model.safetensors").read_bytes() != b"old model"
    aside = [p for p in out.iterdir() if p.name.startswith("overwritten-")]
    assert len(aside) == 1
    assert sorted(p.name for p in aside[0].iterdir()) == [
        "checkpoint-15",
        "checkpoint-20",
        "final_metrics.json",
        "model.safetensors",
    ]
    assert (
        f"moved the earlier run's checkpoints and model files in {out} to {aside[0].name}/" in capsys.readouterr().err
    )


def test_a_second_run_in_the_same_output_dir_is_refused_and_a_killed_holder_leaves_no_stale_lock(tmp_path, capsys):
    """Issue 21 item 2: another process holds output_dir (as a running trainer.sft does); a run there is refused in
    one line naming the holder's pid, exit 2, nothing written; SIGKILL of the holder frees the directory."""
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys; from trainer.loop.checkpoint import hold_output_dir\n"
                f"with hold_output_dir({str(out)!r}):\n    print('held', flush=True); sys.stdin.read()"
            ),
        ],
        stdin=subprocess.PIPE,  # the holder holds until it is killed (or this process ends), however long that is
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = sorted(p.name for p in out.iterdir())
        with kernels.backend("reference"):
            assert sft.main([*FEW_STEPS, "--output_dir", str(out)]) == 2
        line = _one_line_error(capsys)
        assert f"output_dir: {out} is in use by another run (pid {holder.pid})" in line
        assert sorted(p.name for p in out.iterdir()) == before
    finally:
        holder.kill()
        holder.wait()
    with kernels.backend("reference"):
        assert sft.main([*FEW_STEPS, "--output_dir", str(out)]) == 0


def test_leftovers_of_killed_saves_and_rotations_are_removed_at_start(tmp_path, capsys):
    """Issue 21 item 9: safetensors' temporary file of a killed final save, a partial checkpoint and a half-deleted
    one; a rotation renames before removing, so a kill mid-way never leaves a checkpoint-N that looks complete."""
    out = tmp_path / "out"
    _save(out, 1)
    (out / ".tmpAb12Cd").write_bytes(b"\0" * 1000)  # safetensors' NamedTempFile
    (out / "checkpoint-3.tmp").mkdir()
    half = _save(out, 2)
    os.replace(half, out / "checkpoint-2.deleting")
    with kernels.backend("reference"):
        assert sft.main([*FEW_STEPS, "--output_dir", str(out), "--overwrite_output_dir"]) == 0
    err = capsys.readouterr().err
    assert "removed what an interrupted run left: .tmpAb12Cd, checkpoint-2.deleting, checkpoint-3.tmp" in err
    assert not (out / ".tmpAb12Cd").exists() and not list(out.glob("*.deleting")) and not list(out.glob("*.tmp"))


def test_rotation_renames_before_it_removes(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    seen = []
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda p, **k: seen.append(Path(p).name))
    ckpt.rotate_checkpoints(tmp_path, 2)
    assert seen == ["checkpoint-1.deleting"]
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]

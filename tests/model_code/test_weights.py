"""``model_code.weights.packable``: a weights folder that links out of itself is packed through a mirror of hard
links (the MLflow side, a Hugging Face cache snapshot logged: tests/model_code/test_log_model.py)."""

from __future__ import annotations

from pathlib import Path

from model_code.weights import links_out_of, packable


def _folder(tmp_path: Path) -> tuple[Path, Path]:
    """``model/`` with a plain file, a link inside it, and a link out of it to ``blobs/weights``."""
    model, blobs = tmp_path / "model", tmp_path / "blobs"
    model.mkdir()
    blobs.mkdir()
    (model / "config.json").write_text("{}")
    (model / "alias.json").symlink_to("config.json")
    (blobs / "weights").write_bytes(b"\x00" * 4096)
    (model / "model.safetensors").symlink_to(Path("..", "blobs", "weights"))
    return model, blobs


def test_only_links_that_resolve_outside_the_folder_count(tmp_path: Path) -> None:
    model, _ = _folder(tmp_path)
    assert links_out_of(model) == [model / "model.safetensors"]


def test_a_folder_that_links_out_is_mirrored_by_hard_links_and_the_mirror_removed(tmp_path: Path) -> None:
    model, blobs = _folder(tmp_path)
    with packable(model) as mirror:
        assert mirror != model and mirror.name == model.name and not links_out_of(mirror)
        assert (mirror / "model.safetensors").stat().st_ino == (blobs / "weights").stat().st_ino  # linked, not copied
        assert (mirror / "alias.json").read_text() == "{}"
    assert not mirror.exists() and sorted(path.name for path in tmp_path.iterdir()) == ["blobs", "model"]


def test_a_folder_with_nothing_linked_out_is_packed_as_it_is(tmp_path: Path) -> None:
    model, _ = _folder(tmp_path)
    (model / "model.safetensors").unlink()
    with packable(model) as packed:
        assert packed == model


def test_a_link_back_into_the_folder_does_not_loop_and_a_linked_folder_out_counts_once(tmp_path: Path) -> None:
    model, blobs = _folder(tmp_path)
    (model / "model.safetensors").unlink()
    (model / "again").symlink_to(".")
    (model / "shards").symlink_to(blobs)
    assert links_out_of(model) == [model / "shards"]

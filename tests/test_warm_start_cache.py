"""The warm starts the suite trains are cached on disk by a hash of what builds them."""

from __future__ import annotations

from pathlib import Path

import rlinf_lightning.testing as testing


def _files(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_same_arguments_copy_the_cached_build_and_others_train_again(tmp_path, monkeypatch):
    """The SFT (the cost a cache saves) is stood in for by one that records its call and writes a
    file: the second build with the same arguments copies the first's files without training; one
    with another step count trains."""
    trained = []

    def sft(base, train, test, out, **settings):
        trained.append(settings["steps"])
        Path(out).mkdir()
        Path(out, "weights").write_text(f"{settings}")

    monkeypatch.setenv(testing.WARM_START_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(testing, "run_sft", sft)
    tiny = dict(n_train=64, n_test=8, steps=2)
    first = testing.build_warm_started(tmp_path / "a", **tiny)
    second = testing.build_warm_started(tmp_path / "b", **tiny)
    assert trained == [2] and _files(first["root"]) == _files(second["root"])
    assert (second["sft"] / "weights").is_file() and second["train"].is_file()
    testing.build_warm_started(tmp_path / "c", **{**tiny, "steps": 3})
    assert trained == [2, 3]


def test_off_builds_every_time(monkeypatch):
    monkeypatch.setenv(testing.WARM_START_CACHE_ENV, "off")
    assert testing.warm_start_cache() is None

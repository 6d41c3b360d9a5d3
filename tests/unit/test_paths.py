"""kvserve.paths: the one cache root the engine (models) and the kernels (builds) share."""

from kvserve.paths import cache_root


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path


def test_cache_root_defaults_to_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSERVE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "kvserve"

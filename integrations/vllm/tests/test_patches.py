"""The start-up check: an unsupported vLLM version, a missing hook point or a changed signature is a clear error
naming the supported version; installing twice patches once; the dispatch only takes folders with an hf_retrace
block. No engine starts here."""

import types

import pytest

import hf_retrace_vllm
from hf_retrace_vllm import contract, patches


def test_supported_version_passes():
    contract.check()  # the installed vLLM is the pinned one


def test_other_version_is_a_clear_error(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(contract.UnsupportedVllmError, match=r"supports vLLM 0\.32\.0 only \(found 0\.33\.0\)"):
        hf_retrace_vllm.register()


def test_missing_hook_is_a_clear_error(monkeypatch):
    from vllm.v1.spec_decode.dflash import DFlashProposer

    monkeypatch.delattr(DFlashProposer, "build_model_inputs_first_pass")
    with pytest.raises(contract.UnsupportedVllmError, match=r"0\.32\.0.*build_model_inputs_first_pass is missing"):
        contract.check()


def test_changed_signature_is_a_clear_error(monkeypatch):
    from vllm.v1.spec_decode.dflash import DFlashProposer

    monkeypatch.setattr(DFlashProposer, "set_inputs_first_pass", lambda self, token_ids, cad: None)
    with pytest.raises(contract.UnsupportedVllmError, match=r"set_inputs_first_pass takes \('self', 'token_ids'"):
        contract.check()


def test_install_is_idempotent():
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    hf_retrace_vllm.register()
    init, lookahead = GPUModelRunner.__init__, VllmConfig.__dict__["num_lookahead_tokens"]
    hf_retrace_vllm.register()
    assert GPUModelRunner.__init__ is init and VllmConfig.__dict__["num_lookahead_tokens"] is lookahead
    assert getattr(init, contract.MARK) and getattr(lookahead.fget, contract.MARK)
    assert getattr(init, "__wrapped__").__qualname__ == "GPUModelRunner.__init__"  # one wrapper, not two


def _config(method="dflash", block=None):
    hf_config = types.SimpleNamespace(block_size=16, **({} if block is None else {"hf_retrace": block}))
    spec = types.SimpleNamespace(method=method, draft_model_config=types.SimpleNamespace(hf_config=hf_config))
    return types.SimpleNamespace(speculative_config=spec)


def test_dispatch_takes_only_hf_retrace_folders():
    assert patches.is_hf_retrace_config(_config(block={"retrace_mode": "off"}))
    assert not patches.is_hf_retrace_config(_config())  # a z-lab DFlashDraftModel folder
    assert not patches.is_hf_retrace_config(_config(method="eagle3", block={}))
    assert not patches.is_hf_retrace_config(types.SimpleNamespace(speculative_config=None))


def test_block_drop_kept_only_for_other_drafters():
    """vLLM's trailing-block drop (hook point 6) is off for hf-retrace folders, vLLM's own answer for the others."""
    from vllm.config import SpeculativeConfig

    hf_retrace_vllm.register()
    use_eagle_block_drop = SpeculativeConfig.use_eagle_block_drop
    assert getattr(use_eagle_block_drop, contract.MARK)
    ours, theirs = _config(block={"retrace_mode": "off"}), _config()
    for spec in (ours.speculative_config, theirs.speculative_config):
        spec.use_eagle, spec.disable_eagle_block_drop = (lambda: True), False
    assert use_eagle_block_drop(ours.speculative_config) is False
    assert use_eagle_block_drop(theirs.speculative_config) is True

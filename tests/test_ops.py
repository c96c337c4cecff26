"""Eager pieces run with SDPA's cuDNN backend off unless Config.cudnn_attention (CPU-checkable:
the flag is a global setting; a split custom op reads it where attention would run)."""

import pytest
import torch

import cgcompile
from cgcompile.ops import call_without_cudnn_attention

PROBE_OP = "cgcompile_tests::read_cudnn_sdp_flag"
flags_seen: list[bool] = []


@torch.library.custom_op(PROBE_OP, mutates_args=())
def read_cudnn_sdp_flag(x: torch.Tensor) -> torch.Tensor:
    flags_seen.append(torch.backends.cuda.cudnn_sdp_enabled())
    return x.clone()


@read_cudnn_sdp_flag.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture(autouse=True)
def cudnn_sdp_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    flags_seen.clear()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def run_probe(**config) -> torch.Tensor:
    backend = cgcompile.Backend(cgcompile.Config(compiler="eager", splitting_ops=[PROBE_OP], **config))
    fn = torch.compile(lambda x: read_cudnn_sdp_flag(x.sin()).cos(), backend=backend)
    x = torch.randn(4, 8)
    out = fn(x)
    torch.testing.assert_close(out, x.sin().cos())
    assert [p.capturable for p in backend.pieces] == [True, False, True]
    return out


def test_eager_pieces_run_with_cudnn_attention_off_and_the_setting_comes_back():
    torch.backends.cuda.enable_cudnn_sdp(True)
    run_probe()
    assert flags_seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_cudnn_attention_true_leaves_the_setting_alone():
    torch.backends.cuda.enable_cudnn_sdp(True)
    run_probe(cudnn_attention=True)
    assert flags_seen == [True]


def test_a_user_who_turned_cudnn_off_keeps_it_off():
    torch.backends.cuda.enable_cudnn_sdp(False)
    run_probe()
    assert flags_seen == [False]
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_setting_comes_back_when_the_call_raises():
    torch.backends.cuda.enable_cudnn_sdp(True)

    def fails():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        call_without_cudnn_attention(fails)
    assert torch.backends.cuda.cudnn_sdp_enabled()

"""Decoding attention on CUDA runs without torch's cuDNN SDPA backend, and gives the flag back as it found it."""

import pytest
import torch

from inference.attention_backends import decoding_sdpa


@pytest.fixture
def cudnn_sdp_flag():
    """The process-wide flag, restored whatever a test leaves (setting it needs no GPU)."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_cuda_block_runs_without_cudnn_and_restores_it(cudnn_sdp_flag):
    """Guards against the cuDNN backend planning a graph for every new key length while decoding on CUDA
    (1.4 ms of host time per layer per step on an H200), and against leaving it off for the user's own
    code afterwards, an exception included."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    with decoding_sdpa(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(ValueError):
        with decoding_sdpa(torch.device("cuda", 0)):
            raise ValueError("inside")
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_users_choice_is_kept(cudnn_sdp_flag):
    """Guards against turning cuDNN SDPA back on for a user who had turned it off."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    with decoding_sdpa(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_cpu_changes_nothing(cudnn_sdp_flag):
    """Guards against CPU decoding touching CUDA backend flags."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    with decoding_sdpa(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()

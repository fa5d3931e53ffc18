import copy

import pytest
import torch

from components.models import save_model_dir


@pytest.fixture(scope="module")
def two_versions(sft_policy, tmp_path_factory):
    """The SFT policy (version 0) and a perturbed copy saved as an HF directory (to publish as version 1)."""
    model, tokenizer = sft_policy
    perturbed = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    path = save_model_dir(perturbed, tokenizer, tmp_path_factory.mktemp("v1") / "policy")
    return model, perturbed, tokenizer, path


@pytest.fixture
def fresh_model(sft_policy):
    """A private copy of the SFT policy (engines load weights into their model in place)."""
    return copy.deepcopy(sft_policy[0]), sft_policy[1]

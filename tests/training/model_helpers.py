"""Model helpers shared by the training tests (importable: tests/training is on sys.path)."""

import torch

from training.model import Llama, ModelConfig, build_model


def sharp_model(cfg: ModelConfig, seed: int = 0) -> Llama:
    """Large random weights far from init (norm gains too): peaked next-token distributions, so greedy
    paths are far from ties and attention, RoPE and the norms all shape the logits."""
    model = build_model(cfg, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.3 * noise if "norm" in name else 0.3 * noise)
    return model.eval()

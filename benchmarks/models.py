"""Models the benchmarks share."""

from __future__ import annotations

import torch


class Decoder(torch.nn.Module):
    """A GPT-2-shaped causal decoder built from torch's own layers."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.position = torch.nn.Embedding(context, d_model)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(t, device=tokens.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.norm(x) @ self.embed.weight.t()


def deep_mlp(depth: int = 75, width: int = 256, seed: int = 0) -> torch.nn.Sequential:
    """A deep tanh MLP at torch's default initialisation: each layer passes back about 0.6 of the
    gradient it receives, so after one backward the gradients vanish towards the input (75 layers of
    256: the last layer's near 1e-5, the median near 1e-14, the first layer's near 1e-23)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers)


def deep_mlp_shapes(depth: int = 75, width: int = 256) -> list[list[int]]:
    """The parameter shapes of ``deep_mlp(depth, width)``, in parameter order (no model built)."""
    return [[width, width], [width]] * depth


def deep_mlp_gradients(depth: int = 75, width: int = 256, batch: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """The gradients of ``deep_mlp(depth, width, seed)`` after one backward of a mean-square loss on a
    seeded random batch, in parameter order (fp32, on the CPU): real vanishing gradients."""
    model = deep_mlp(depth, width, seed)
    inputs = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed + 1))
    model(inputs).square().mean().backward()
    return [p.grad.detach() for p in model.parameters() if p.grad is not None]

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

"""A readable, nanoGPT-sized decoder-only transformer (GPT-2/GPT-3 architecture).

This module is plain PyTorch and knows nothing about parallelism. Its layout is
chosen so that the parallel layers elsewhere in exatrain can be applied to it
without rewriting it:

* ``GPT.blocks`` is an ``nn.ModuleList`` of :class:`Block`, so activation
  checkpointing, ``torch.compile``, FSDP wrapping or pipeline stage splitting
  can be applied one block at a time.
* Attention uses separate ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``
  linears (not one fused ``qkv``), so tensor parallelism can shard q/k/v
  column-wise (heads split across ranks) and ``out_proj`` row-wise; the MLP is
  ``fc_in`` (column-wise) -> GELU -> ``fc_out`` (row-wise) for the same reason.
* The ``lm_head`` is untied from the token embedding by default, so every
  ``nn.Linear`` owns its weight.

Sizes are described by :class:`GPTConfig`, which can count parameters and
FLOPs from the configuration alone (no allocation), so billion-parameter
presets can be inspected on a laptop.

Example::

    cfg = GPTConfig.preset("10m")
    model = GPT(cfg)
    logits = model(idx)                 # (B, T, vocab_size)
    loss = gpt_loss(logits, targets)    # mean cross entropy in nats
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelInputError, ModelOptionError

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "gpt_loss",
    "flops_per_token",
    "PRESETS",
]

# Named model shapes. The larger ones mirror Table 2.1 of the GPT-3 paper
# (Brown et al., 2020, "Language Models are Few-Shot Learners") and use the
# GPT-2 BPE vocabulary padded to 50304 (a multiple of 128, which keeps the
# embedding/head matmuls on fast kernel tiles). The two smallest ones use the
# byte-level vocabulary of ``exatrain.data.text`` so they can be trained on the
# offline corpus out of the box.
#
# ``params`` is the advertised (lo, hi) range of ``GPTConfig.num_params()`` for
# the preset as built (untied ``lm_head``). The names follow the GPT-3 paper,
# whose counts assume a tied head; untying adds ``vocab_size * n_embd``, which is
# why e.g. "125m" is ~163M here. Two deviations from the paper's table, both to
# keep ``n_embd`` divisible by ``n_head``: "1.3b" uses 16 heads of 128 (the
# paper lists 24 heads of 128 for d_model=2048, which is inconsistent), and
# "13b" uses d_model=5120 instead of 5140.
PRESETS: dict[str, dict[str, Any]] = {
    "1m": dict(shape=dict(vocab_size=256, block_size=256, n_layer=5, n_head=4, n_embd=128),
               params=(0.8e6, 1.3e6)),
    "10m": dict(shape=dict(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384),
                params=(9e6, 12e6)),
    "125m": dict(shape=dict(vocab_size=50304, block_size=2048, n_layer=12, n_head=12, n_embd=768),
                 params=(120e6, 170e6)),
    "350m": dict(shape=dict(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=1024),
                 params=(340e6, 420e6)),
    "760m": dict(shape=dict(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=1536),
                 params=(740e6, 850e6)),
    "1.3b": dict(shape=dict(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
                 params=(1.25e9, 1.45e9)),
    "2.7b": dict(shape=dict(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=2560),
                 params=(2.6e9, 2.9e9)),
    "6.7b": dict(shape=dict(vocab_size=50304, block_size=2048, n_layer=32, n_head=32, n_embd=4096),
                 params=(6.5e9, 7.0e9)),
    "13b": dict(shape=dict(vocab_size=50304, block_size=2048, n_layer=40, n_head=40, n_embd=5120),
                params=(12.5e9, 13.5e9)),
}


@dataclass(frozen=True)
class GPTConfig:
    """Shape and regularisation of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids (256 for the byte-level tokenizer).
        block_size: maximum sequence length (size of the position embedding).
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: model (residual stream) width.
        dropout: dropout probability on attention weights and residual branches.
        bias: whether Linear and LayerNorm layers carry a bias (GPT-2: True).
        mlp_ratio: MLP hidden width as a multiple of ``n_embd``.
        tie_weights: share the token embedding with ``lm_head``. Off by default
            so every Linear is independent (simpler tensor/pipeline sharding).
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    mlp_ratio: int = 4
    tie_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelOptionError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ModelOptionError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ModelOptionError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``n_embd // n_head``)."""
        return self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """Hidden width of the MLP (``mlp_ratio * n_embd``)."""
        return self.mlp_ratio * self.n_embd

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        """Build a named configuration, optionally overriding fields.

        Names (see :data:`PRESETS` for shapes and advertised parameter ranges):
        "1m", "10m" (byte vocabulary, block 256) and the GPT-3 shapes
        "125m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b" (vocab 50304,
        block 2048). Example: ``GPTConfig.preset("125m", vocab_size=256)``.
        """
        key = name.lower()
        if key not in PRESETS:
            raise KeyError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[key]["shape"], **overrides})

    @staticmethod
    def preset_names() -> list[str]:
        """Names accepted by :meth:`preset`, smallest first."""
        return list(PRESETS)

    def replace(self, **changes: Any) -> "GPTConfig":
        """Return a copy with some fields changed (the config is frozen)."""
        return dataclasses.replace(self, **changes)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count computed from the config alone (no allocation).

        Matches ``GPT(config).num_params(non_embedding)`` exactly; use this for
        models too large to build. With ``non_embedding=True`` the lookup
        tables (position embedding, and the token embedding unless it is tied
        to ``lm_head``) are excluded, because a lookup costs no FLOPs; this is
        the ``N`` of :func:`flops_per_token`.
        """
        V, T, E, L, Hm = self.vocab_size, self.block_size, self.n_embd, self.n_layer, self.mlp_hidden
        b = 1 if self.bias else 0
        layer_norm = E + b * E
        attention = 4 * (E * E + b * E)  # q, k, v, out projections
        mlp = (E * Hm + b * Hm) + (Hm * E + b * E)
        block = 2 * layer_norm + attention + mlp
        wte, wpe = V * E, T * E
        lm_head = 0 if self.tie_weights else V * E  # lm_head never has a bias
        total = wte + wpe + L * block + layer_norm + lm_head
        if non_embedding:
            total -= wpe
            if not self.tie_weights:
                total -= wte
        return total


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs (forward + backward) per token: ``6N + 12·L·H·Q·T``.

    This is the estimate of the PaLM paper (Chowdhery et al., 2022, Appendix B,
    used for its "model FLOPs utilization") and of nanoGPT's
    ``estimate_mfu``: ``6N`` for the weight matmuls (2 FLOPs per multiply-add,
    times 3 for forward + backward) plus ``12·L·H·Q·T`` for the attention
    score and value matmuls, with ``L`` layers, ``H`` heads, ``Q`` head width
    and ``T`` sequence length. ``N`` is the non-embedding parameter count
    (:meth:`GPTConfig.num_params` with ``non_embedding=True``); it includes
    ``lm_head``. The causal mask is not discounted, as in both references.

    Args:
        config: model shape.
        seq_len: training sequence length; defaults to ``config.block_size``.
    """
    T = config.block_size if seq_len is None else seq_len
    if T <= 0:
        raise ValueError(f"seq_len must be positive, got {T}")
    N = config.num_params(non_embedding=True)
    return 6 * N + 12 * config.n_layer * config.n_head * config.head_dim * T


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/out projections.

    Projections are kept separate (instead of one fused ``qkv``) so tensor
    parallelism can split ``q_proj``/``k_proj``/``v_proj`` column-wise by head
    and ``out_proj`` row-wise. ``n_head`` is read at forward time from the
    projection width, so a column-sharded copy with fewer local heads works.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        E = config.n_embd
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(E, E, bias=config.bias)
        self.k_proj = nn.Linear(E, E, bias=config.bias)
        self.v_proj = nn.Linear(E, E, bias=config.bias)
        self.out_proj = nn.Linear(E, E, bias=config.bias)
        self.attn_dropout_p = config.dropout  # applied inside SDPA, training only
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, T, n_embd)`` to ``(B, T, n_embd)``; position t sees only <= t."""
        B, T, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            # -1 (not config.n_head) so a head-sharded projection still works.
            return t.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, h, T, Q)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout_p if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``fc_in`` -> GELU -> ``fc_out``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(..., n_embd)`` to ``(..., n_embd)``."""
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, T, n_embd)`` to ``(B, T, n_embd)``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model returning logits.

    Layout: ``wte`` (token embedding) + ``wpe`` (learned position embedding)
    -> dropout -> ``blocks`` (``nn.ModuleList`` of :class:`Block`) -> ``ln_f``
    -> ``lm_head``. ``forward(idx)`` returns logits; compute the loss with
    :func:`gpt_loss` so the model stays a pure function of its input (handy for
    pipeline stages and loss-parallel variants).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation, in place.

        Linear and embedding weights ~ N(0, 0.02), biases zero, LayerNorm
        weight one. The projections that write into the residual stream
        (``attn.out_proj`` and ``mlp.fc_out``) use std ``0.02 / sqrt(2 *
        n_layer)`` because each block adds two such branches and the residual
        variance would otherwise grow with depth (GPT-2 paper, section 2.3).
        Public so that a model built on the meta device and materialised with
        ``to_empty()`` can be re-initialised.
        """
        std = 0.02
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        for block in self.blocks:
            nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.fc_out.weight, mean=0.0, std=resid_std)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of parameters (shared tensors counted once).

        ``non_embedding=True`` excludes ``wpe`` and, unless tied to
        ``lm_head``, ``wte`` — see :meth:`GPTConfig.num_params`.
        """
        total = sum(p.numel() for p in self.parameters())  # parameters() dedups ties
        if non_embedding:
            total -= self.wpe.weight.numel()
            if not self.config.tie_weights:
                total -= self.wte.weight.numel()
        return total

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(B, T)`` (int64, ``T <= block_size``) to logits ``(B, T, vocab_size)``."""
        if idx.dim() != 2:
            raise ModelInputError(f"GPT expects token ids of shape (B, T), got "
                                  f"{tuple(idx.shape)}: feed each sample as a 1-D sequence")
        T = idx.size(1)
        if T > self.config.block_size:
            raise ModelInputError(
                f"sequence length {T} exceeds block_size={self.config.block_size}: build the "
                f"model with block_size >= {T} (model.block_size={T}), or feed sequences of at "
                f"most {self.config.block_size} tokens"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Autoregressively extend ``idx`` ``(B, T)`` by ``max_new_tokens`` sampled tokens.

        ``temperature=0`` means greedy decoding. The context is cropped to the
        last ``block_size`` tokens. No KV cache: this is for demos, not serving.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size:]
            logits = self(context)[:, -1, :]
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy (nats) over all ``B*T`` positions.

    Args:
        logits: ``(B, T, V)`` from :meth:`GPT.forward`.
        targets: ``(B, T)`` int64 token ids; positions equal to
            ``ignore_index`` are excluded from the mean.
    """
    if logits.shape[:-1] != targets.shape:
        raise ModelInputError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on (B, T): "
            f"give each sample as many target tokens as input tokens"
        )
    # Upcast so bf16/fp16 logits do not lose precision in the log-softmax.
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=ignore_index
    )

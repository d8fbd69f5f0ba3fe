"""GPT workload: a decoder-only language model on the Python standard library's own source.

Data: `exatrain data text --out DIR` (or `prepare`, once, when `data.generate` is on) writes the
byte-level corpus of `exatrain.data.text` — the stdlib's .py files, one token per byte — as
`train.bin` / `val.bin`, read back through `numpy.memmap`. A sample is `model.block_size` tokens
and their next tokens.

Model: `exatrain.models.gpt.GPT`, from a preset (`model.preset = "1m" | "10m" | "125m" | ...`) or
from explicit sizes; any size field set to a non-zero value overrides the preset's.

Loss: `gpt_loss`, mean next-token cross entropy in nats. Validation: `val_loss` (nats per token),
`val_bits_per_byte` (= val_loss / ln 2: the byte tokenizer makes a token a byte) and
`val_perplexity`. Baseline: `baseline_unigram_loss`, the cross entropy of predicting every byte
from the training set's byte frequencies, which any model that learns context must beat.

Throughput: the Trainer reports `tokens_per_s` (`tokens_per_sample` = block size) and MFU from
`flops_per_sample` = `block_size × flops_per_token` (6N + 12·L·H·Q·T, PaLM's estimate).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Subset

from ..data.text import TokenDataset, write_text_corpus
from ..models.gpt import GPT, GPTConfig, flops_per_token, gpt_loss
from .base import InputOptions, Workload
from ..errors import ConfigError, MissingFileError

_DEFAULT_SHAPE = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)


@dataclass
class ModelOptions:
    preset: str = ""          # "1m", "10m", "125m", ... (models.gpt.PRESETS); "" = the fields below
    vocab_size: int = 0       # 0 = the preset's (or 256)
    block_size: int = 0       # tokens per sample; 0 = the preset's (or 128)
    n_layer: int = 0          # 0 = the preset's (or 4)
    n_head: int = 0           # 0 = the preset's (or 4)
    n_embd: int = 0           # 0 = the preset's (or 128)
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = False


@dataclass
class DataOptions(InputOptions):
    path: str = "data/text"         # directory with train.bin, val.bin, meta.json
    generate: bool = True           # write the stdlib corpus there if it is missing
    max_bytes: int = 8_000_000      # corpus size when generating (0 = the whole stdlib)
    val_fraction: float = 0.05
    val_samples: int = 256          # validation samples evaluated (0 = all)


def model_config(options: ModelOptions) -> GPTConfig:
    """The GPTConfig the options describe (preset, then non-zero fields override)."""
    sizes = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
    base = GPTConfig.preset(options.preset) if options.preset else GPTConfig(**_DEFAULT_SHAPE)
    overrides = {k: getattr(options, k) for k in sizes if getattr(options, k)}
    return base.replace(**overrides, mlp_ratio=options.mlp_ratio, dropout=options.dropout,
                        bias=options.bias, tie_weights=options.tie_weights)


def prepare(config, progress=None) -> Path:
    """Write the corpus once if asked and missing (run on one process, before build)."""
    d = config.data
    path = Path(d.path)
    if d.generate and not (path / "meta.json").is_file():
        write_text_corpus(path, max_bytes=d.max_bytes or None, val_fraction=d.val_fraction)
    return path


def unigram_loss(train_file: Path, vocab_size: int) -> float:
    """Cross entropy (nats) of predicting each token from the training set's token frequencies."""
    tokens = np.memmap(train_file, dtype=np.uint8, mode="r")
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def build(config, mesh) -> Workload:
    m, d = config.model, config.data
    path = Path(d.path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise MissingFileError(f"no text corpus in {path} (meta.json missing); write it with "
                               f"`exatrain data text --out {path}` or set data.generate=true.")
    meta = json.loads(meta_file.read_text())
    cfg = model_config(m)
    if cfg.vocab_size < meta["vocab_size"]:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the corpus "
                          f"vocabulary ({meta['vocab_size']} for the {meta['tokenizer']} "
                          "tokenizer); set model.vocab_size=0 or at least that.")
    train_set = TokenDataset(path / meta["train_file"], block_size=cfg.block_size)
    val_set = TokenDataset(path / meta["val_file"], block_size=cfg.block_size)
    if d.val_samples and d.val_samples < len(val_set):
        # evenly spaced blocks across the whole validation text
        picks = np.linspace(0, len(val_set) - 1, d.val_samples).round().astype(int).tolist()
        val_set = Subset(val_set, picks)
    model = GPT(cfg)

    def metric_sums(logits, targets):
        nll = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                              reduction="sum")
        return {"nll": nll, "tokens": torch.tensor(float(targets.numel()))}

    def finalize(s):
        loss = float(s["nll"] / s["tokens"])
        return {"val_loss": loss, "val_bits_per_byte": loss / math.log(2),
                "val_perplexity": math.exp(min(loss, 50.0))}

    workload = Workload(
        model=model, train_set=train_set, val_set=val_set, loss_fn=gpt_loss,
        metric_sums=metric_sums, finalize=finalize,
        baselines={"baseline_unigram_loss": unigram_loss(path / meta["train_file"],
                                                         cfg.vocab_size),
                   "params": float(model.num_params())},
        flops_per_sample=float(cfg.block_size * flops_per_token(cfg, cfg.block_size)))
    workload.tokens_per_sample = cfg.block_size  # for the Trainer's tokens/s
    return workload

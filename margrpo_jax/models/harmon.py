"""Harmon (wusize/Harmon): MAR encoder -> Qwen2.5 -> MAR decoder, text-to-image through the MAR sampler
(docs/models.md section 2).

Components (top-level attributes, so the trained / frozen split is by name): ``mar`` (MAR-B or MAR-H encoder /
decoder with its position tables, ``mask_token``, ``fake_latent`` and the unused ``class_emb``: the only part RL
trains, docs/algorithm.md section 9), ``llm`` (Qwen2.5, frozen), ``proj_in`` / ``proj_out`` (``Linear, SiLU, Linear``,
frozen) and ``head`` (SimpleMLPAdaLN, frozen).

One backbone call ``z = backbone(canvas, mask, ids)`` (docs/models.md section 2.2):
1. ``x, visible = mar.encode(canvas, mask, fake_latent in all buffer slots)`` (after ``encoder_norm``);
2. ``u = proj_in(x)`` reordered to ``[image tokens ; buffer]``;
3. ``h = llm([embed(ids) ; u])`` under the causal mask with keys restricted to the valid text tokens
   (``ids >= 0``) and the visible image tokens plus the buffer; positions ``cumsum(valid) - 1``, so the image
   part continues right after the last text token (the official prompt cache + gathered visible tokens compute
   exactly this: masked image rows are computed here but nobody attends to them and the decoder replaces them);
4. ``z = mar.decode(x + proj_out(h reordered back to [buffer ; image]), visible)``.
The condition is the prompt's token ids (B, text.max_len) padded with -1; the CFG null condition is the null
prompt ``<|im_start|>user\\nGenerate an image.<|im_end|>\\n<|im_start|>assistant\\n`` whose ids are a static model
setting (``model.text.null_ids``: the null condition is built from the batch size alone, so the model must know
them; the converter writes them from a tokenizer.json beside the weights, and :meth:`Harmon.prompt_ids` checks them
against the tokenizer it loads). Released models run at 512 px: 32 x 32 tokens, the 16 x 16 learned position tables
bilinearly resized (MARBackbone ``pos_seq_len``).

How to use::

    python -m margrpo_jax.convert --family=harmon --src=harmon_0.5b.pth --out=HARMON   # + tokenizer.json beside it
    python -m margrpo_jax.convert --family=kl16 --src=kl16.ckpt --out=KL16
    python -m margrpo_jax.main --config=configs/harmon.py:0.5b --config.mode=sample --workdir=W \\
        --config.checkpoint=HARMON --config.model.tokenizer_path=Qwen2.5-0.5B-Instruct \\
        --config.model.vae_checkpoint=KL16 --config.prompts="a red apple,a blue car"
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from margrpo_jax.checkpoint import CheckpointError
from margrpo_jax.models import class_mar, families, qwen2, qwen_tokenizer, vae
from margrpo_jax.models.class_mar import ClassConditionedBackbone
from margrpo_jax.models.diffusion_head import SimpleMLPAdaLN
from margrpo_jax.models.layers import linear

SIZES = {"0.5b": ("0.5b", "base"), "1.5b": ("1.5b", "huge")}  # Harmon size -> (Qwen2.5 size, MAR size)


def harmon_config(size: str = "0.5b", image_size: int = 512, text_len: int = 128) -> ml_collections.ConfigDict:
  """Harmon-0.5B / 1.5B at ``image_size`` px (KL-16: 16 px per token)."""
  if size not in SIZES:
    raise ValueError(f"Harmon size {size!r} is not one of {', '.join(SIZES)}")
  llm_size, mar_size = SIZES[size]
  width, depth, heads, head_depth, head_width = class_mar.SIZES[mar_size]
  grid = image_size // 16
  return ml_collections.ConfigDict(dict(
      family="harmon", size=size, token_dim=16, buffer_size=64, seq_len=grid * grid, pos_seq_len=256,
      llm=qwen2.qwen2_config(llm_size).to_dict(),
      mar=dict(width=width, encoder_depth=depth, decoder_depth=depth, num_heads=heads, mlp_ratio=4.0,
               num_classes=1000),
      head=dict(width=head_width, depth=head_depth),
      diffusion=dict(num_train_steps=1000, sampling_steps="100"),
      text=dict(max_len=text_len, null_ids=[]),
      tokenizer_path="",   # the Qwen2.5 tokenizer.json (or its folder), set at sampling time
      vae_checkpoint="",   # the KL-16 export that decodes the tokens, set at sampling time
  ))


class Projector(nnx.Module):
  """Harmon's ``Sequential(Linear(din, hidden), SiLU, Linear(hidden, dout))`` (``.0`` -> fc1, ``.2`` -> fc2)."""

  def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
    self.fc1 = linear(din, hidden, rngs)
    self.fc2 = linear(hidden, dout, rngs)

  def __call__(self, x):
    return self.fc2(jax.nn.silu(self.fc1(x)))


class _Backbone:
  """``model.backbone`` as the MAR sampler and the RL code see it: the whole Harmon forward with MAR's sizes."""

  def __init__(self, model: "Harmon"):
    self._model = model
    m = model.mar
    self.seq_len, self.token_dim, self.buffer_size, self.width = m.seq_len, m.token_dim, m.buffer_size, m.width

  def __call__(self, tokens: jax.Array, mask: jax.Array, cond: jax.Array) -> jax.Array:
    return self._model.forward(tokens, mask, cond)


class Harmon(families.Generator):
  """Components ``mar`` (trained), ``llm``, ``proj_in``, ``proj_out``, ``head`` (frozen)."""

  policy_components = ("mar",)
  condition_ndim = 2  # conditions are token ids (B, text.max_len), -1 = padding

  def __init__(self, cfg: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    m, hidden = cfg.mar, cfg.llm.hidden_size
    self.mar = ClassConditionedBackbone(
        num_classes=m.num_classes, seq_len=cfg.seq_len, pos_seq_len=cfg.pos_seq_len, token_dim=cfg.token_dim,
        buffer_size=cfg.buffer_size, width=m.width, encoder_depth=m.encoder_depth, decoder_depth=m.decoder_depth,
        num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, rngs=rngs)
    self.llm = qwen2.Qwen2Model(cfg.llm, rngs=rngs)
    self.proj_in = Projector(m.width, hidden, hidden, rngs=rngs)
    self.proj_out = Projector(hidden, hidden, m.width, rngs=rngs)
    self.head = SimpleMLPAdaLN(token_dim=cfg.token_dim, cond_dim=m.width, rngs=rngs, **cfg.head)
    self.text_len = cfg.text.max_len
    self.null_ids = tuple(int(i) for i in cfg.text.null_ids)
    if len(self.null_ids) > self.text_len:
      raise ValueError(f"model.text.null_ids has {len(self.null_ids)} tokens, more than text.max_len={self.text_len}")

  @property
  def backbone(self) -> _Backbone:
    return _Backbone(self)

  def forward(self, tokens: jax.Array, mask: jax.Array, ids: jax.Array) -> jax.Array:
    """``tokens`` (B, L, 16), ``mask`` (B, L) True = unknown, ``ids`` (B, T) -> z (B, L, D_mar)."""
    b, nb, t = tokens.shape[0], self.mar.buffer_size, self.text_len
    chex.assert_shape(ids, (b, t))
    x, visible = self.mar.encode(tokens, mask, self.mar.null(b))
    u = self.proj_in(x)
    u = jnp.concatenate([u[:, nb:], u[:, :nb]], axis=1)                   # [image ; buffer]
    text_valid = ids >= 0
    valid = jnp.concatenate([text_valid, visible[:, nb:], visible[:, :nb]], axis=1)
    emb = self.llm.embed(jnp.where(text_valid, ids, 0))
    h = self.llm(jnp.concatenate([emb, u.astype(emb.dtype)], axis=1), valid)[:, t:]
    h = jnp.concatenate([h[:, -nb:], h[:, :-nb]], axis=1)                 # [buffer ; image]
    return self.mar.decode(x + self.proj_out(h).astype(x.dtype), visible)

  def condition(self, ids: jax.Array) -> jax.Array:
    """Prompt token ids (B, T) -> the condition the backbone takes: the ids themselves (int32)."""
    chex.assert_shape(ids, (None, self.text_len))
    return ids.astype(jnp.int32)

  def null_condition(self, batch: int) -> jax.Array:
    """The null prompt's ids (``model.text.null_ids``) for every row, padded with -1."""
    if not self.null_ids:
      raise CheckpointError("model.text.null_ids is empty: the checkpoint's model.json must list the token ids of "
                       f"{qwen_tokenizer.null_prompt()!r} (Harmon.prompt_ids prints them for your tokenizer).")
    row = np.full((self.text_len,), qwen_tokenizer.PAD, np.int32)
    row[:len(self.null_ids)] = self.null_ids
    return jnp.broadcast_to(jnp.asarray(row), (batch, self.text_len))

  @staticmethod
  def prompt_ids(model_cfg: ml_collections.ConfigDict, prompts: list[str]) -> np.ndarray:
    """Captions -> Harmon prompt ids (N, text.max_len) int32 with the tokenizer at ``model_cfg.tokenizer_path``;
    also checks that the model's null prompt ids are this tokenizer's."""
    tok = qwen_tokenizer.load(model_cfg.get("tokenizer_path"))
    null = qwen_tokenizer.encode(tok, [qwen_tokenizer.null_prompt()], model_cfg.text.max_len)[0]
    null = [int(i) for i in null if i >= 0]
    if list(model_cfg.text.null_ids) != null:
      raise CheckpointError(f"the checkpoint's model.text.null_ids {list(model_cfg.text.null_ids)} are not the "
                       f"tokenizer's ids of the null prompt {null}: write \"null_ids\": {null} into the \"text\" "
                       "block of the checkpoint's model.json (or convert with tokenizer.json beside the weights).")
    return qwen_tokenizer.encode(tok, qwen_tokenizer.harmon_prompts(list(prompts)), model_cfg.text.max_len)

  @staticmethod
  def decode_images(model_cfg: ml_collections.ConfigDict, tokens: np.ndarray) -> np.ndarray:
    """Token canvases (N, seq_len, 16) -> (N, 16 grid, 16 grid, 3) uint8 through the KL-16 export."""
    return vae.decode_tokens(model_cfg.get("vae_checkpoint"), tokens)


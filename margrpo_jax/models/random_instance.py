r"""Few-layer random-weight instances of the real families (``configs/{mar,harmon,nova}.py:random``): the families'
own code paths (MAR's class embedding, Harmon's Qwen2.5 between the MAR encoder and decoder, NOVA's Phi-2, video
encoder and flow head, each with its VAE decoder) at small widths, built from nothing outside the repository.

:func:`model_config` gives the model config of a family; :func:`materialize` writes, once per folder, everything a
converted checkpoint would bring for a model config (``config.model`` of a ``:random`` config): the model export
(``model/``, random weights drawn from ``seed``), a VAE export (``vae/``, random weights) and, for the text
families, a byte-level ``tokenizer.json`` (every UTF-8 byte is one token, plus Qwen's chat special tokens; no
merges, so no training data). The model's ``model.json`` points at the
other two, so sampling, RL, eval and export treat the folder like any converted checkpoint.

Token layout: MAR and Harmon sample KL-16-style latents (16 channels, one latent pixel per token); NOVA samples
2 x 2 patches of a 4-channel SD-style latent. The VAE halves its resolution twice, so a g x g token grid decodes to
4g x 4g px (MAR / Harmon) or 8g x 8g px (NOVA).
"""
from __future__ import annotations

import os

import jax
import ml_collections
import numpy as np
from flax import nnx

from margrpo_jax import fileio

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's chat tokens (Phi-2 ignores them)
FAMILIES = ("mar", "harmon", "nova")
INITS = ("", "random")  # config.init: '' = the checkpoint (or the shipped base) | 'random': materialize() here


def model_config(family: str) -> ml_collections.ConfigDict:
  """The model config of the ``family``'s random-weight instance (module docstring)."""
  if family == "mar":
    from margrpo_jax.models import class_mar
    cfg = class_mar.mar_config("base")
    cfg.update(size="random", num_classes=10, buffer_size=4, seq_len=64)
    cfg.backbone.update(width=32, encoder_depth=1, decoder_depth=1, num_heads=2)
    cfg.head.update(width=32, depth=1)
  elif family == "harmon":
    from margrpo_jax.models import harmon
    cfg = harmon.harmon_config("0.5b", image_size=128, text_len=96)
    cfg.update(size="random", pos_seq_len=16, buffer_size=4)
    cfg.llm.update(vocab_size=272, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=48,
                   num_layers=2)
    cfg.mar.update(width=32, num_heads=2, num_classes=10, encoder_depth=1, decoder_depth=1)
    cfg.head.update(width=32, depth=1)
    from margrpo_jax.models import qwen_tokenizer
    null = qwen_tokenizer.encode(byte_tokenizer(), [qwen_tokenizer.null_prompt()], cfg.text.max_len)[0]
    cfg.text.null_ids = [int(i) for i in null if i >= 0]  # the byte tokenizer's null prompt
  elif family == "nova":
    from margrpo_jax.models import nova
    cfg = nova.nova_config("d48w1024-sd512", width=32, num_heads=2, video_depth=1, image_depth=2, encoder_depth=1,
                           image_base_size=[4, 4], video_base_size=[1, 2, 2], seq_len=16)
    cfg.text.update(max_len=48, token_dim=48, null_rows=64, pad_id=0)
    cfg.head.update(width=32, depth=1)
    cfg.text_encoder.update(vocab_size=272, width=48, depth=1, num_heads=4, mlp_dim=64)
  else:
    raise ValueError(f"no tiny instance of the {family!r} family (one of {', '.join(FAMILIES)})")
  cfg.diffusion.sampling_steps = 10 if family == "nova" else "10"
  return cfg


def vae_config(family: str) -> ml_collections.ConfigDict:
  from margrpo_jax.models import vae
  kind = "sd" if family == "nova" else "kl16"
  return vae.vae_config(kind, ch=8, ch_mult=(1, 2, 2), num_res_blocks=1, norm_groups=4, enc_attn_levels=(),
                        dec_attn_levels=())


def byte_tokenizer():
  """A byte-level BPE tokenizer without merges (ids 0..255 = bytes, then :data:`SPECIAL`)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(list(SPECIAL))
  return tok


def _save(folder: str, cfg: ml_collections.ConfigDict, seed: int) -> str:
  from margrpo_jax import checkpoint
  from margrpo_jax.models import families
  if os.path.isfile(os.path.join(folder, "model.json")):
    return folder
  params = nnx.to_pure_dict(nnx.state(families.build(cfg, seed)))
  # The families zero-initialise their output and AdaLN modulation matrices (as the official code does before
  # training); a random instance with them at zero would ignore its condition and have no policy gradient.
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda x: (0.02 * rng.standard_normal(x.shape)).astype(x.dtype)
                        if x.ndim >= 2 and not np.any(x) else x, jax.tree.map(np.asarray, params))
  return checkpoint.save_model(folder, params, cfg)


def materialize(model_cfg: ml_collections.ConfigDict, folder: str, seed: int = 0) -> str:
  """Write a random-weight instance of ``model_cfg`` (a :func:`model_config`, possibly overridden) under
  ``folder`` (kept when already there); returns the model export. Deterministic in ``seed``."""
  family = model_cfg.family
  if family not in FAMILIES:
    raise ValueError(f"no tiny instance of the {family!r} family (one of {', '.join(FAMILIES)})")
  folder = os.path.abspath(folder)
  cfg = ml_collections.ConfigDict(model_cfg.to_dict())
  cfg.vae_checkpoint = _save(os.path.join(folder, "vae"), vae_config(family), seed + 1)
  if family in ("harmon", "nova"):
    cfg.tokenizer_path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(cfg.tokenizer_path):  # process 0 writes it before the collective saves below
      fileio.write_text(cfg.tokenizer_path, byte_tokenizer().to_str())
  return _save(os.path.join(folder, "model"), cfg, seed)


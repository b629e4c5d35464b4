"""Model semantics: the key-masked encoder equals MAR's drop-the-masked-tokens encoder; text conditioning."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from margrpo_jax.models import text
from margrpo_jax.sampling import sampler as S


def _mar_reference(bb, tokens, mask, cond):
  """MAR's forward (docs/models.md section 1.2) with the masked tokens physically dropped (same count per row)."""
  b, seq_len, _ = tokens.shape
  x = jnp.concatenate([cond, bb.z_proj(tokens)], axis=1)
  x = bb.z_proj_ln(x + bb.encoder_pos_embed_learned[...])
  keep = np.concatenate([np.ones((b, bb.buffer_size), bool), ~np.asarray(mask)], axis=1)
  idx = np.stack([np.nonzero(k)[0] for k in keep])  # (B, buffer + visible)
  h = jnp.take_along_axis(x, idx[..., None], axis=1)
  for blk in bb.encoder_blocks:
    h = blk(h)
  h = bb.decoder_embed(bb.encoder_norm(h))
  full = jnp.broadcast_to(bb.mask_token[...], (b, bb.buffer_size + seq_len, bb.width))
  full = full.at[np.arange(b)[:, None], idx].set(h) + bb.decoder_pos_embed_learned[...]
  for blk in bb.decoder_blocks:
    full = blk(full)
  return bb.decoder_norm(full)[:, bb.buffer_size:] + bb.diffusion_pos_embed_learned[...]


@pytest.mark.slow
def test_key_masked_encoder_equals_dropping_masked_tokens(small_model):
  model_cfg, graphdef, params = small_model
  model = nnx.merge(graphdef, params)
  b, seq_len = 3, model_cfg.seq_len
  tokens = jax.random.uniform(jax.random.key(0), (b, seq_len, model_cfg.token_dim), minval=-1, maxval=1)
  rng = np.random.default_rng(0)
  mask = np.zeros((b, seq_len), bool)
  for i in range(b):
    mask[i, rng.permutation(seq_len)[:45]] = True  # 45 masked, 19 visible in every row
  cond = model.text_encoder(jnp.asarray(text.tokenize(["a red circle", "two cyan squares", "x"], 12)))
  z = model.backbone(tokens, jnp.asarray(mask), cond)
  ref = _mar_reference(model.backbone, tokens, mask, cond)
  np.testing.assert_allclose(z, ref, rtol=2e-5, atol=2e-5)
  # Masked tokens' content does not leak: changing them leaves z unchanged.
  z2 = model.backbone(jnp.where(mask[..., None], 7.0, tokens), jnp.asarray(mask), cond)
  np.testing.assert_allclose(z2, z, rtol=1e-6, atol=1e-6)


def test_encoder_on_the_known_tokens_equals_the_key_masked_one(small_model):
  """``encode_known`` (the official encoder's work: buffer + known tokens, padding key-masked) gives the latents of
  the key-masked pass over all positions, whatever the padding holds."""
  model_cfg, graphdef, params = small_model
  bb = nnx.merge(graphdef, params).backbone
  b, seq_len, n_known, k = 3, model_cfg.seq_len, 19, 30
  tokens = jax.random.uniform(jax.random.key(1), (b, seq_len, model_cfg.token_dim), minval=-1, maxval=1)
  order = jnp.stack([jax.random.permutation(jax.random.key(i), seq_len) for i in range(b)])
  mask = jnp.ones((b, seq_len), bool).at[jnp.arange(b)[:, None], order[:, :n_known]].set(False)
  prompts = text.tokenize(["a red circle", "two cyan squares", "x"], 12)
  cond = nnx.merge(graphdef, params).text_encoder(jnp.asarray(prompts))
  want = bb(tokens, mask, cond)
  got = bb.decode(*bb.encode_known(tokens, order[:, :k], n_known, cond))  # 11 padded positions
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  exact = bb.decode(*bb.encode_known(tokens, order[:, :n_known], n_known, cond))  # no padding
  np.testing.assert_allclose(exact, want, rtol=2e-5, atol=2e-5)


def test_bucketed_encoder_equals_the_key_masked_one_for_a_traced_mask(small_model):
  """``sampler.latents`` (the RL update's encoder on the known tokens only, padded to one of a few static sizes and
  chosen by ``lax.switch`` under jit) gives the latents of the key-masked pass, for every known count from 0 to L,
  rows of a batch with different counts included."""
  model_cfg, graphdef, params = small_model
  model = nnx.merge(graphdef, params)
  b, seq_len = 3, model_cfg.seq_len
  assert S.known_sizes(seq_len, 4) == tuple(-(-seq_len * i // 4) for i in (1, 2, 3, 4))
  tokens = jax.random.uniform(jax.random.key(1), (b, seq_len, model_cfg.token_dim), minval=-1, maxval=1)
  cond = model.text_encoder(jnp.asarray(text.tokenize(["a red circle", "two cyan squares", "x"], 12)))
  full = jax.jit(lambda m: model.backbone(tokens, m, cond))
  gathered = jax.jit(lambda m: S.latents(model, tokens, m, cond, buckets=4))
  for n in (0, 1, seq_len // 4, seq_len // 4 + 1, seq_len - 1, seq_len):
    counts = jnp.array([n, max(n - 3, 0), n // 2])  # the fullest row picks the size
    order = jnp.stack([jax.random.permutation(jax.random.key(10 * n + i), seq_len) for i in range(b)])
    mask = jnp.arange(seq_len)[None] >= counts[:, None]  # known: the first counts[r] of each row's order
    mask = jnp.zeros((b, seq_len), bool).at[jnp.arange(b)[:, None], order].set(mask)
    np.testing.assert_allclose(gathered(mask), full(mask), rtol=2e-5, atol=2e-5, err_msg=f"{n} known")


def test_text_conditioning_and_null(small_model):
  model_cfg, graphdef, params = small_model
  model = nnx.merge(graphdef, params)
  ids = text.tokenize(["a red circle to the left of a blue square", "a blue square to the left of a red circle",
                       "A Red Circle!", "a red circle"], model_cfg.text.max_len)
  assert ids[0, 0] == text.VOCAB.index("a") and (ids[0, 10:] == text.PAD).all()
  np.testing.assert_array_equal(ids[2], ids[3])  # case and punctuation are ignored
  assert text.tokenize(["a photo of a bench"], 12)[0, 1] == text.UNK
  c = model.text_encoder(jnp.asarray(ids))
  assert c.shape == (4, model_cfg.text.max_len, model_cfg.backbone.width)
  assert float(jnp.abs(c[0] - c[1]).max()) > 1e-3  # word order matters (position prompts)
  null = model.text_encoder.null(2)
  np.testing.assert_array_equal(null[0], null[1])

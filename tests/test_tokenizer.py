"""The shapes-world tokenizer: its job trains and resumes, the shipped one draws back what it encodes, and a model
whose token layout does not match its tokenizer is refused in one sentence."""
import jax
import numpy as np
import pytest

from margrpo_jax import checkpoint, config_files
from margrpo_jax.data import shapes
from margrpo_jax.jobs import tokenizer
from margrpo_jax.models import tiny, vae
from margrpo_jax.rewards import shapes_verifier


def _run(workdir, max_steps=None):
  config = config_files.load("shapes_tokenizer", "smoke")
  return tokenizer.run(config, str(workdir), max_steps_this_run=max_steps)


@pytest.mark.slow
def test_tokenizer_job_resumes_and_exports(tmp_path):
  full = _run(tmp_path / "full")
  _run(tmp_path / "killed", max_steps=2)  # "killed" after its step-2 checkpoint
  resumed = _run(tmp_path / "killed")
  assert int(resumed["step"]) == int(full["step"]) == 4
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), full,
                                          resumed)))
  cfg = checkpoint.read_model_config(str(tmp_path / "full" / "export"), family="vae")
  assert cfg.scale > 0 and (tmp_path / "full" / "tokenizer.json").exists()
  tokens = vae.encode_tokens(str(tmp_path / "full" / "export"), shapes.render_batch(
      [shapes.sample_metadata(np.random.default_rng(0)) for _ in range(2)], 0))
  assert tokens.shape == (2, 16, cfg.embed_dim)


def test_the_shipped_tokenizer_draws_back_what_it_encodes():
  """Encode (posterior mode) then decode 64 eval-split renders, tasks in turn: the verifier passes >= 95 % of them
  (measured when shipped: docs/tokenizer.md) and >= 99 % of the pixels keep their palette class."""
  recs = shapes.stratified_subset(shapes.split_records("eval"), 64)
  images = shapes.render_batch(recs, 0)
  tokens = vae.encode_tokens(checkpoint.resolve("shapes_tokenizer"), images)
  assert tokens.shape == (64, 16, 8)
  assert 0.7 < float(np.std(tokens)) < 1.4  # the export's scale whitens the latents
  back = vae.decode_tokens(checkpoint.resolve("shapes_tokenizer"), tokens)
  strict = np.mean([shapes_verifier.verify(im, r)["strict"] for im, r in zip(back, recs)])
  same = np.mean(shapes_verifier.classify_pixels(back) == shapes_verifier.classify_pixels(images))
  assert strict >= 0.95 and same >= 0.99, (strict, same)


def test_a_token_layout_that_does_not_match_its_tokenizer_is_one_sentence():
  cfg = tiny.tiny_config("shapes_tokenizer")
  assert (cfg.seq_len, cfg.token_dim) == (16, 8)
  tiny.check_tokenizer(cfg)
  cfg.token_dim = 48
  with pytest.raises(checkpoint.CheckpointError, match="token_dim=48 do not match the tokenizer 'shapes_tokenizer'"):
    tiny.check_tokenizer(cfg, "config.model")
  cfg.vae_checkpoint = "shapes_base"  # a MAR export, not a tokenizer
  with pytest.raises(checkpoint.CheckpointError, match="holds a model of family 'tiny', not 'vae'"):
    tiny.check_tokenizer(cfg)

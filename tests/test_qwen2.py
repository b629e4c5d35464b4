"""Qwen2 decoder vs ``transformers.Qwen2Model`` (tiny random config), the ``qwen2`` converter from a
``save_pretrained`` folder, and the Qwen2.5 tokenizer loader with Harmon's chat template."""
from __future__ import annotations

import numpy as np
import pytest

from margrpo_jax.convert import __main__ as convert_cli, core
from margrpo_jax.models import qwen_tokenizer

ATOL = 2e-5  # float32 parity; measured 1.8e-6 with |h| <= 3.0


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """A tiny random ``Qwen2ForCausalLM`` (every parameter randomised, norms around 1) saved as HF safetensors."""
  import torch
  import transformers
  torch.manual_seed(0)
  config = transformers.Qwen2Config(
      vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
      tie_word_embeddings=True, attn_implementation="eager")
  model = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  folder = tmp_path_factory.mktemp("qwen2")
  model.save_pretrained(folder)
  return model, str(folder)


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory):
  from margrpo_jax import checkpoint
  out = str(tmp_path_factory.mktemp("qwen2_export"))
  report = convert_cli.run("qwen2", hf[1], out)
  return report, checkpoint.load_model(out)


def _ours(converted):
  from flax import nnx
  _, (cfg, graphdef, params) = converted
  return cfg, nnx.merge(graphdef, params)


def test_converter_reads_config_and_covers_every_key(converted):
  report, (cfg, _, params) = converted
  assert report["target_parameters"] == report["used"]
  assert cfg.family == "qwen2" and cfg.num_kv_heads == 2 and cfg.head_dim == 16 and cfg.rope_theta == 1e6
  assert params["layers"][1]["self_attn"]["k_proj"]["kernel"].shape == (64, 32)


def test_last_hidden_state_matches_transformers(hf, converted):
  """Right padding and a Harmon-style padded gap (text pad, then more tokens) with positions cumsum(mask) - 1."""
  import torch
  model, _ = hf
  cfg, ours = _ours(converted)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, cfg.vocab_size, (2, 12))
  valid = np.ones((2, 12), bool)
  valid[0, 9:] = False      # right padding
  valid[1, 5:7] = False     # padding between the text and the continuation
  pos = np.maximum(np.cumsum(valid, 1) - 1, 0)
  with torch.no_grad():
    ref = model.model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(valid.astype(np.int64)),
                      position_ids=torch.tensor(pos)).last_hidden_state.numpy()
  import jax.numpy as jnp
  got, hidden = ours(ours.embed(jnp.asarray(ids)), jnp.asarray(valid), output_hidden_states=True)
  np.testing.assert_allclose(np.asarray(got)[valid], ref[valid], atol=ATOL, rtol=0)
  assert len(hidden) == cfg.num_layers + 1 and hidden[-1] is got
  # default positions are cumsum(valid) - 1, as Harmon builds them
  np.testing.assert_allclose(np.asarray(ours(ours.embed(jnp.asarray(ids)), jnp.asarray(valid)))[valid], ref[valid],
                             atol=ATOL, rtol=0)


def test_corrupted_key_is_named(hf):
  from safetensors.numpy import load_file
  sd = {k: v for k, v in load_file(f"{hf[1]}/model.safetensors").items() if k != "model.layers.1.mlp.up_proj.weight"}
  with pytest.raises(core.ConversionError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
    from margrpo_jax.convert import qwen2 as conv_qwen2
    conv_qwen2.convert(sd, origin=hf[1])


def build_tokenizer(folder) -> str:
  """A small byte-level BPE ``tokenizer.json`` with Qwen's chat special tokens (trained in milliseconds) in
  ``folder``; returns the folder. Ids stay below 320."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(["Generate an image: a red apple on a table.", "Generate an image.", "user assistant"] * 5,
                          trainer)
  tok.save(str(folder / "tokenizer.json"))
  return str(folder)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
  return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_tokenizer_applies_the_chat_template_exactly(tokenizer_json):
  tok = qwen_tokenizer.load(tokenizer_json)
  assert qwen_tokenizer.load(tokenizer_json + "/tokenizer.json") is tok  # folder or file, loaded once
  prompts = qwen_tokenizer.harmon_prompts(["a red apple"]) + [qwen_tokenizer.null_prompt()]
  assert prompts == ["<|im_start|>user\nGenerate an image: a red apple<|im_end|>\n<|im_start|>assistant\n",
                     "<|im_start|>user\nGenerate an image.<|im_end|>\n<|im_start|>assistant\n"]
  ids = qwen_tokenizer.encode(tok, prompts, max_len=64)
  assert ids.dtype == np.int32 and ids.shape == (2, 64)
  start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
  for row, text in zip(ids, prompts):
    n = int((row >= 0).sum())
    assert (row[n:] == qwen_tokenizer.PAD).all() and (row[:n] >= 0).all()
    assert row[0] == start and list(row[:n]).count(start) == 2 and list(row[:n]).count(end) == 1
    assert tok.decode(row[:n].tolist(), skip_special_tokens=False) == text


def test_tokenizer_errors_are_one_sentence(tokenizer_json, tmp_path):
  with pytest.raises(qwen_tokenizer.TokenizerError, match="model.tokenizer_path is not set"):
    qwen_tokenizer.load("")
  with pytest.raises(qwen_tokenizer.TokenizerError, match=r"no tokenizer file .*tokenizer\.json"):
    qwen_tokenizer.load(str(tmp_path))
  with pytest.raises(qwen_tokenizer.TokenizerError, match="model.text.max_len=4"):
    qwen_tokenizer.encode(qwen_tokenizer.load(tokenizer_json), [qwen_tokenizer.null_prompt()], max_len=4)

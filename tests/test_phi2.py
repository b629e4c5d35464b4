"""Phi-2 text encoder: parity with transformers.PhiModel (tiny random config), the converter on the exact
key names of keys_phi2_text_encoder.txt (scaled-down shapes), and the tokenizer hook's errors and padding."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from margrpo_jax.convert import core, phi2 as phi2_convert
from margrpo_jax.models import families, phi2

from conftest import KEYS  # noqa: E402


def read_keys(name: str) -> dict[str, tuple[int, ...]]:
  """``{key: shape}`` of a keys/*.txt file (``name<TAB>[d0, d1]<TAB>count`` per line)."""
  out = {}
  with open(os.path.join(KEYS, name)) as f:
    for line in f:
      if line.strip():
        key, shape, _ = line.split("\t")
        out[key] = tuple(int(s) for s in shape.strip("[] \n").split(",") if s.strip())
  return out


def synthetic(keys: dict, scale: dict[int, int], seed: int = 0) -> dict[str, np.ndarray]:
  """Random float32 tensors under exactly ``keys``, every dim mapped through ``scale`` (unlisted dims kept)."""
  rng = np.random.default_rng(seed)
  return {k: rng.standard_normal(tuple(scale.get(d, d) for d in s)).astype(np.float32) for k, s in keys.items()}


@pytest.fixture(scope="module")
def tiny_pair():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  cfg = transformers.PhiConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, partial_rotary_factor=0.4, max_position_embeddings=64,
                               layer_norm_eps=1e-5, hidden_act="gelu_new", rope_theta=10000.0)
  ref = transformers.PhiForCausalLM(cfg).eval()
  sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
  model_cfg, params, report = phi2_convert.convert(sd, origin="tiny", head_dim=16)
  return torch, ref, model_cfg, params, report


def test_parity_with_transformers_phi(tiny_pair):
  """Converted weights give PhiModel's last_hidden_state (final LN included) within atol 1e-4 (float32)."""
  from flax import nnx
  torch, ref, model_cfg, params, report = tiny_pair
  assert report["ignored"]["next-token head, unused by a text encoder (NOVA reads last_hidden_state)"] == 2
  ids = np.random.default_rng(1).integers(0, 97, (2, 11)).astype(np.int32)
  with torch.no_grad():
    want = ref.model(input_ids=torch.from_numpy(ids).long()).last_hidden_state.numpy()
  graphdef, state = nnx.split(nnx.eval_shape(lambda: families.build(model_cfg)))
  nnx.replace_by_pure_dict(state, params)
  got = np.asarray(jax.jit(lambda s, i: nnx.merge(graphdef, s)(i))(state, jnp.asarray(ids)))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_rope_only_on_rotary_dims():
  """RoPE touches the first rotary_dim dims only and is the identity at position 0."""
  x = np.random.default_rng(0).standard_normal((1, 3, 2, 10)).astype(np.float32)
  cos, sin = phi2.rope_tables(3, 4, 1e4)
  y = np.asarray(jax.jit(phi2.apply_partial_rope)(jnp.asarray(x), cos, sin))
  np.testing.assert_array_equal(y[..., 4:], x[..., 4:])
  np.testing.assert_allclose(y[:, 0], x[:, 0], atol=1e-7)


def test_converter_exact_key_names():
  """Every key of keys_phi2_text_encoder.txt (2560->32, 10240->64, 51200->50; 32 layers) is used, except
  lm_head.{weight,bias} which are ignored with a reason; every target leaf is filled."""
  keys = read_keys("keys_phi2_text_encoder.txt")
  assert len(keys) == 453
  sd = synthetic(keys, {2560: 32, 10240: 64, 51200: 50})
  cfg = phi2_convert.infer_config(sd, head_dim=8)
  assert (cfg.depth, cfg.width, cfg.num_heads, cfg.vocab_size) == (32, 32, 4, 50)
  target = abstract_phi(cfg)

  def run(sd):
    conv = core.Converter(sd, target, "synthetic")
    conv.ignore(*phi2_convert.LM_HEAD)
    phi2_convert.convert_into(conv)
    return conv.result(), conv.report()

  params, report = run(sd)
  assert report["used"] == 451 and report["source_keys"] == 453
  np.testing.assert_array_equal(params["layers"][3]["self_attn"]["dense"]["kernel"],
                                sd["model.layers.3.self_attn.dense.weight"].T)
  del sd["model.layers.5.mlp.fc2.bias"]
  with pytest.raises(core.ConversionError, match="layers.5.mlp.fc2.bias"):
    run(sd)


def abstract_phi(cfg):
  """Abstract Phi params: one layer traced, then repeated ``cfg.depth`` times (the layers are identical; tracing
  all of them with ``nnx.eval_shape`` costs time quadratic in the number of parameters)."""
  one = phi2.phi2_config(**{**cfg.to_dict(), "depth": 1})
  tree = core.abstract_params(one, lambda c: phi2.Phi2(c, rngs=phi2_convert._rngs()))
  tree["layers"] = {i: tree["layers"][0] for i in range(cfg.depth)}
  return tree


def test_full_size_parameter_count():
  """Abstract Phi-2 has the 2,648.56 M parameters of docs/models.md section 3.5 (keys file minus lm_head)."""
  keys = read_keys("keys_phi2_text_encoder.txt")
  want = sum(int(np.prod(s)) for k, s in keys.items() if not k.startswith("lm_head"))
  tree = abstract_phi(phi2.phi2_config())
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree)) == want
  assert round(want / 1e6, 2) == 2648.56


def test_tokenizer_errors_and_padding(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  with pytest.raises(phi2.TokenizerError, match="tokenizer_path is not set"):
    phi2.tokenize(["a"], None)
  with pytest.raises(phi2.TokenizerError, match="does not exist"):
    phi2.tokenize(["a"], str(tmp_path / "nowhere"))
  vocab = {"[UNK]": 0, "a": 1, "red": 2, "cat": 3}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  ids = phi2.tokenize(["a red cat", "", "cat cat cat cat cat"], str(tmp_path), max_len=4)
  np.testing.assert_array_equal(ids, [[1, 2, 3, -1], [-1, -1, -1, -1], [3, 3, 3, 3]])

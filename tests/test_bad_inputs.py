"""Bad input, tried as a user would: every case ends in exit code 2, one line starting with ``error:`` that names
the key, value or file, no traceback, and nothing in the workdir touched. The commands run through
``tests/cli_runner.py`` (one interpreter, a forked child per command: the imports are paid once)."""
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # whole jobs end to end (the fast tier skips them)

RL, PRETRAIN, SAMPLE, EVAL, ABLATION = (f"--config=configs/{n}.py" for n in
                                        ("shapes_rl", "shapes_pretrain", "shapes_sample", "shapes_eval",
                                         "shapes_ablation"))
MAR, HARMON, NOVA = (f"--config=configs/{n}.py:random" for n in ("mar", "harmon", "nova"))
CAPTIONS = REPO / "configs" / "prompts" / "captions.txt"
BASE = REPO / "margrpo_jax" / "assets" / "shapes_base"
TOKENIZER = REPO / "margrpo_jax" / "assets" / "shapes_tokenizer"

# (case id, entry module, arguments ({T}: the case's fixture folder, {W}: a fresh workdir), text the error names)
CASES = [
    ("workdir_empty", "main", [RL, "--workdir="], "--workdir is required and must not be empty"),
    ("checkpoints_without_record", "main", [RL, "--workdir={T}/no_record"], "no readable config.json"),
    ("lr_nan", "main", [RL, "--config.optim.lr=nan"], "optim.lr=nan"),
    ("lr_negative", "main", [RL, "--config.optim.lr=-1e-4"], "optim.lr=-0.0001"),
    ("lr_inf", "main", [RL, "--config.optim.lr=inf"], "optim.lr=inf"),
    ("b1", "main", [RL, "--config.optim.b1=1.5"], "optim.b1=1.5"),
    ("decay", "main", [RL, "--config.optim.decay=linear"], "optim.decay='linear'"),
    ("warmup", "main", [RL, "--config.optim.warmup_steps=-5"], "optim.warmup_steps=-5"),
    ("grad_clip", "main", [RL, "--config.optim.grad_clip=0"], "optim.grad_clip=0"),
    ("prompts_per_iter", "main", [RL, "--config.rl.prompts_per_iter=0"], "rl.prompts_per_iter=0"),
    ("num_iters_0", "main", [RL, "--config.num_iters=0"], "num_iters=0"),
    ("num_iters_neg", "main", [RL, "--config.num_iters=-3"], "num_iters=-3"),
    ("group_size", "main", [RL, "--config.rl.group_size=1"], "rl.group_size=1"),
    ("topk", "main", [RL, "--config.rl.topk_fraction=1.5"], "rl.topk_fraction=1.5"),
    ("mte_seeds", "main", [RL, "--config.rl.mte_seeds=-1"], "rl.mte_seeds=-1"),
    ("advantage", "main", [RL, "--config.rl.advantage=ppo"], "rl.advantage='ppo'"),
    ("kl_typo", "main", [RL, "--config.rl.official.kl=gausian"], "rl.official.kl='gausian'"),
    ("estimator", "main", [RL, "--config.rl.estimator=dpo"], "rl.estimator='dpo'"),
    ("official_except", "main", [RL, "--config.rl.fidelity=official", "--config.rl.official_except=beta"],
     "rl.official_except names 'beta'"),
    ("pixel_ratio", "main", [RL, "--config.rl.official.uncertainty_unit=pixel"],
     "rl.official.uncertainty_unit='pixel'"),
    ("topk_random", "main", [RL, "--config.rl.official.topk_random=1"], "rl.official.topk_random=1"),
    ("old_switch_name", "main", [RL, "--config.rl.mte_actual=keep"], "it moved: --config.rl.official.mte_actual"),
    ("old_save_name", "main", [PRETRAIN, "--config.checkpoint.every=2"], "it moved: --config.save.every"),
    ("fidelity", "main", [RL, "--config.rl.fidelity=exact"], "rl.fidelity='exact'"),
    ("window", "main", [RL, "--config.rl.diffusion_window=1-3"], "rl.diffusion_window='1-3'"),
    ("minibatches", "main", [RL, "--config.rl.num_minibatches=3"], "rl.num_minibatches=3"),
    ("microbatch", "main", [RL, "--config.rl.microbatch=3"], "rl.microbatch=3"),
    ("elbo_rows", "main", [RL, "--config.rl.elbo_rows=100", "--config.rl.num_minibatches=8"], "rl.elbo_rows=100"),
    ("rollout_prompts", "main", [RL, "--config.rl.rollout_prompts=2"], "rl.rollout_prompts=2"),
    ("ema", "main", [RL, "--config.rl.ema_decay=1.0"], "rl.ema_decay=1.0"),
    ("wise", "main", [RL, "--config.rl.export_interpolation=0"], "rl.export_interpolation=0"),
    ("augment_chain", "main", [RL, "--config.rl.estimator=chain", "--config.rl.elbo_rows=0",
                               "--config.rl.augment=shift"], "rl.augment='shift'"),
    ("beta", "main", [RL, "--config.rl.beta=-0.1"], "rl.beta=-0.1"),
    ("clip_eps", "main", [RL, "--config.rl.clip_eps=nan"], "rl.clip_eps=nan"),
    ("no_reward", "main", [RL, "--config.rl.rewards.shapes_strict=0"], "rl.rewards"),
    ("learned_reward_no_ckpt", "main", [RL, "--config.rl.rewards.hps=1"], "rewards.hps.checkpoint"),
    ("reward_inf", "main", [RL, "--config.rl.rewards.jpeg_compressibility=inf"], "rl.rewards.jpeg_compressibility"),
    ("temperature", "main", [RL, "--config.sampling.temperature=0"], "sampling.temperature=0"),
    ("cfg_scale", "main", [RL, "--config.sampling.cfg_scale=-1"], "sampling.cfg_scale=-1"),
    ("respacing", "main", [RL, "--config.sampling.diffusion_steps=abc"], "sampling.diffusion_steps='abc'"),
    ("cfg_schedule", "main", [RL, "--config.sampling.cfg_schedule=cosine"], "sampling.cfg_schedule='cosine'"),
    ("ar_steps", "main", [RL, "--config.sampling.num_steps=0"], "sampling.num_steps=0"),
    ("mesh_devices", "main", [RL, "--config.parallel.mesh.data=3"], "parallel.mesh"),
    ("mesh_two_free", "main", [RL, "--config.parallel.mesh.fsdp=-1"], "at most one -1"),
    ("eval_prompts", "main", [RL, "--config.eval.num_prompts=0"], "eval.num_prompts=0"),
    ("save_every", "main", [RL, "--config.save.every=0"], "save.every=0"),
    ("seed", "main", [RL, "--config.seed=-1"], "seed=-1"),
    ("export_dtype", "main", [RL, "--config.export.dtype=float16"], "export.dtype='float16'"),
    ("ckpt_missing", "main", [RL, "--config.checkpoint=/no/such/export"], "/no/such/export"),
    ("ckpt_not_generator", "main", [RL, f"--config.checkpoint={TOKENIZER}"], "'vae' model, not an image generator"),
    ("ckpt_garbage_json", "main", [RL, "--config.checkpoint={T}/garbage"], "model.json is not a model config"),
    ("ckpt_unknown_family", "main", [RL, "--config.checkpoint={T}/alien"], "names model family 'alien'"),
    ("workdir_is_file", "main", [RL, "--workdir={T}/a_file"], "is a file, not a folder"),
    # offline, the bucket's host does not resolve ("cannot be reached"); online, the bucket does not exist
    ("workdir_bucket", "main", [RL, "--workdir=gs://margrpo-no-such-bucket-0/run"],
     "--workdir=gs://margrpo-no-such-bucket-0/run"),
    ("workdir_scheme", "main", [RL, "--workdir=ftp://host/run"], "ftp:// scheme is not supported"),
    ("coordinator_silent", "main", [RL, "--config.parallel.distributed=True", "--config.parallel.init_timeout_s=2"],
     "did not answer within 2 s"),
    ("workdir_under_file", "main", [RL, "--workdir={T}/a_file/run"], "cannot be created"),
    ("resume_other_config", "main", [RL, "--workdir={T}/old_run", "--config.optim.lr=1e-3",
                                     "--config.eval.num_prompts=4"], "eval.num_prompts (512 -> 4)"),
    ("resume_num_iters", "main", [RL, "--workdir={T}/old_run", "--config.num_iters=300"], "--allow_changes"),
    ("pretrain_batch", "main", [PRETRAIN, "--config.batch_size=0"], "batch_size=0"),
    ("pretrain_ema", "main", [PRETRAIN, "--config.ema_decay=1.5"], "ema_decay=1.5"),
    ("pretrain_label_drop", "main", [PRETRAIN, "--config.mar.label_drop=1.0"], "mar.label_drop=1.0"),
    ("pretrain_mask_ratio", "main", [PRETRAIN, "--config.mar.mask_ratio=linear"], "mar.mask_ratio='linear'"),
    ("sample_mismatched_export", "main", [SAMPLE, "--config.checkpoint={T}/wider"], "has shape"),
    ("sample_no_prompt_file", "main", [SAMPLE, "--config.prompt_file=/no/such.jsonl"], "/no/such.jsonl"),
    ("sample_temperature", "main", [SAMPLE, "--config.sampling.temperature=-1"], "sampling.temperature=-1"),
    ("eval_empty_entry", "main", [EVAL, "--config.checkpoints=,"], "empty entry"),
    ("eval_reward", "main", [EVAL, "--config.reward_names=beauty"], "beauty"),
    ("eval_images", "main", [EVAL, "--config.images_per_prompt=0"], "images_per_prompt=0"),
    ("eval_dataset", "main", [EVAL, "--config.dataset=coco"], "dataset='coco' is not one of"),
    ("eval_learned_reward_missing", "main", [EVAL, "--config.rewards.hps.checkpoint=/no/such/hps"],
     "/no/such/hps"),
    ("heads_do_not_divide", "main", [MAR, "--config.model.backbone.num_heads=5"], "not divisible by num_heads 5"),
    ("tokenizer_groups", "main", ["--config=configs/shapes_tokenizer.py:smoke", "--config.model.norm_groups=3"],
     "config.model cannot encode and decode"),
    ("official_except_without_official", "main", [RL, "--config.rl.official_except=beta"],
     "only applies with rl.fidelity='official'"),
    ("model_negative", "main", [NOVA, "--config.model.text.max_len=-1"], "config.model.text.max_len=-1"),
    ("nova_temperature_unread", "main", [NOVA, "--config.sampling.temperature=0.5"], "would be ignored"),
    ("ablation_variant", "main", [ABLATION, "--config.variants=nosuch"], "'nosuch'"),
    ("ablation_seeds", "main", [ABLATION, "--config.seeds=a,b"], "seeds='a,b'"),
    ("unknown_key", "main", [SAMPLE, "--config.nonexistent=1"], "'nonexistent'"),
    ("key_typo", "main", [SAMPLE, "--config.sampling.num_stepz=3"], "did you mean 'num_steps'"),
    ("bad_type", "main", [SAMPLE, "--config.seed=abc"], "--config.seed=abc"),
    ("mode", "main", [SAMPLE, "--config.mode=fly"], "config.mode='fly'"),
    ("missing_config_file", "main", ["--config=configs/no_such.py"], "configs/no_such.py"),
    ("unknown_preset", "main", ["--config=configs/shapes_rl.py:focussed"], "'focussed'"),
    ("renamed_config_arg", "main", ["--config=configs/mar.py:tiny"], "config arg 'tiny' is now 'random'"),
    ("frozen_dtype", "main", [RL, "--config.rl.frozen_dtype=float16"],
     "rl.frozen_dtype='float16' is not one of float32, bfloat16"),
    ("plan_variant", "main", ["--config=configs/mar.py:base", "--workdir={T}/plan", "--config.plan.variants=rl.remat=no"],
     "plan.variants='rl.remat=no': rl.remat='no' is not a bool like rl.remat=True"),
    ("sample_ckpt_missing", "main", [SAMPLE, "--config.checkpoint=/no/such/ckpt"], "/no/such/ckpt"),
    ("sample_prompt_file_json", "main", [SAMPLE, "--config.prompt_file={T}/bad.jsonl"], "line 2: not valid JSON"),
    ("empty_window", "main", [RL, "--config.rl.diffusion_window=20:10"], "window 20:10 holds no diffusion step"),
    ("window_too_small", "main", [RL, "--config.rl.num_diffusion_steps=30"], "does not fit the scored-step window"),
    ("mte_actual", "main", [RL, "--config.rl.official.mte_actual=drop"],
     "rl.official.mte_actual='drop' is not one of keep"),
    ("ar_steps_rl", "main", [RL, "--config.rl.num_ar_steps=40"],
     "rl.num_ar_steps=40 must lie in [0, 8], the AR steps of sampling.num_steps=8"),
    ("nova_verifier", "main", [NOVA, "--config.rl.rewards.shapes_strict=1"], "but the base is a nova model"),
    ("harmon_learned_no_ckpt", "main", [HARMON, "--config.rl.rewards.hps=1"], "rewards.hps.checkpoint"),
    ("mar_captions", "main", [MAR, f"--config.rl.prompt_file={CAPTIONS}"], "not a class label"),
    ("verifier_on_captions", "main", [RL, f"--config.rl.prompt_file={CAPTIONS}"],
     "without shapes-world metadata (e.g. 'a red apple on a table')"),
    ("nova_elbo", "main", [NOVA, "--config.rl.estimator=token_elbo", "--config.rl.mte_seeds=0"], "rl.estimator='chain'"),
    ("nova_ode_rollouts", "main", [NOVA, "--config.rl.flow_noise_level=0"], "rl.flow_noise_level=0.0 must lie"),
    ("rl_prompt_file_missing", "main", [HARMON, "--config.rl.prompt_file=/no/such/prompts.txt"],
     "/no/such/prompts.txt"),
    ("random_init_family", "main", [RL, "--config.init=random"], "no tiny instance of the 'tiny' family"),
    ("sample_steps_over_tokens", "main", [SAMPLE, "--config.sampling.num_steps=17"],
     "sampling.num_steps=17 must lie in [1, 16]"),
    ("mode_switched_config", "main", [SAMPLE, "--config.mode=export"], "config.mode='export' needs the keys"),
    ("seed_too_large", "main", [SAMPLE, "--config.seed=99999999999"], "must be at most 2147483647"),
    ("eval_split", "main", [EVAL, "--config.split=bogus"], "not a shapes-world split"),
    ("eval_prompts_huge", "main", [RL, "--config.eval.num_prompts=100000000"], "must be at most 100,000"),
    ("model_heads", "main", [NOVA, "--config.model.num_heads=7"], "does not build a nova model"),
    ("random_init_user_vae", "main", [HARMON, "--config.model.vae_checkpoint=/my/vae"],
     "config.model.vae_checkpoint='/my/vae' would be ignored"),
    ("convert_random_bytes", "convert", ["--family=mar", "--src={T}/weights.safetensors", "--out={W}"],
     "weights.safetensors"),
    ("convert_family", "convert", ["--family=dalle", "--src={T}/weights.safetensors", "--out={W}"], "dalle"),
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# per-case environment: process 1 of 2 whose coordinator (a port nobody listens on) never answers
ENV = {"coordinator_silent": dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2",
                                  JAX_PROCESS_ID="1")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """``{case id: (returncode, output, fixture folder, workdir)}`` for every case, run in one batch."""
  from margrpo_jax import config_files
  root = tmp_path_factory.mktemp("bad_inputs")
  fx = root / "fixtures"
  fx.mkdir()
  (fx / "a_file").write_text("not a folder\n")
  for name, text in (("garbage", "{not json"), ("alien", '{"family": "alien"}')):
    (fx / name / "params").mkdir(parents=True)
    (fx / name / "model.json").write_text(text)
  wider = json.loads((BASE / "model.json").read_text())
  wider["head"]["width"] *= 2
  (fx / "wider").mkdir()
  (fx / "wider" / "model.json").write_text(json.dumps(wider))
  os.symlink(BASE / "params", fx / "wider" / "params")
  (fx / "old_run" / "checkpoints").mkdir(parents=True)
  (fx / "no_record" / "checkpoints" / "5").mkdir(parents=True)  # a run whose config.json was deleted
  (fx / "old_run" / "config.json").write_text(config_files.load("shapes_rl").to_json(indent=2, sort_keys=True))
  (fx / "weights.safetensors").write_bytes(os.urandom(4096))
  (fx / "bad.jsonl").write_text('{"prompt": "a red circle"}\n{"prompt": "x",\n')
  cases = []
  for cid, module, args, _ in CASES:
    wd = root / "work" / cid
    args = [a.replace("{T}", str(fx)).replace("{W}", str(wd)) for a in args]
    if module == "main" and not any(a.startswith("--workdir=") for a in args):
      args.append(f"--workdir={wd}")
    cases.append(dict(module=f"margrpo_jax.{module}", argv=args, cwd=str(REPO), env=ENV.get(cid, {})))
  (root / "cases.json").write_text(json.dumps(cases))
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
  subprocess.run([sys.executable, str(REPO / "tests" / "cli_runner.py"), str(root / "cases.json"),
                  str(root / "results.json")], cwd=REPO, env=env, check=True, timeout=900)
  out = json.loads((root / "results.json").read_text())
  return {c[0]: (r["returncode"], r["output"], fx, root / "work" / c[0]) for c, r in zip(CASES, out)}


def test_the_table_is_large():
  assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("cid,needle", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_sentence_and_exit_2(results, cid, needle):
  code, output, fx, wd = results[cid]
  errors = [line for line in output.splitlines() if line.startswith("error:")]
  assert code == 2, (code, output[-2000:])
  assert len(errors) == 1 and needle in errors[0], output[-2000:]
  assert "Traceback" not in output
  assert not wd.exists() or cid.startswith("convert"), f"{wd} was created"


def test_a_url_workdir_creates_no_local_folder_named_after_it(results):
  for case in ("workdir_bucket", "workdir_scheme"):
    assert results[case][0] == 2
  assert not (REPO / "gs:").exists() and not (REPO / "ftp:").exists()


def test_a_refused_resume_leaves_the_run_as_it_was(results):
  from margrpo_jax import config_files
  _, output, fx, _ = results["resume_other_config"]
  assert "optim.lr (0.0001 -> 0.001)" in output
  assert (fx / "old_run" / "config.json").read_text() == config_files.load("shapes_rl").to_json(indent=2,
                                                                                                sort_keys=True)
  assert sorted(os.listdir(fx / "old_run")) == ["checkpoints", "config.json"]
  shutil.rmtree(fx / "old_run")


def test_a_batch_that_does_not_split_over_the_devices_of_all_processes_is_one_sentence(monkeypatch):
  """On a pod the mesh spans every process's devices (here: 2 processes x 4 devices, faked); a batch that does
  not split over data x fsdp is refused before anything runs."""
  import jax
  from margrpo_jax import config_files, validate
  monkeypatch.setattr(jax, "device_count", lambda: 8)
  c = config_files.load("shapes_rl", "smoke")  # 2 prompts x 2 images
  c.parallel.mesh.update(data=1, fsdp=8, tensor=1)
  with pytest.raises(config_files.ConfigError, match=r"= 4 images \(4 per minibatch\) cannot be split over the "
                                                     r"batch axes data x fsdp = 8"):
    validate.check_mesh(c)
  c.rl.group_size = 4
  validate.check_mesh(c)  # 8 images: one per device
  c.eval.batch_size = 6
  with pytest.raises(config_files.ConfigError, match="eval.batch_size=6 cannot be split"):
    validate.check_mesh(c)
  p = config_files.load("shapes_pretrain", "smoke")
  p.parallel.mesh.update(data=2, fsdp=4, tensor=1)
  p.batch_size = 12
  with pytest.raises(config_files.ConfigError, match="batch_size=12 cannot be split over the batch axes"):
    validate.check_mesh(p)

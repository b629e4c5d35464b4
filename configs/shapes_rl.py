"""MAR-GRPO fine-tuning of the shipped shapes-world base (``config.mode = 'rl'``).

python -m margrpo_jax.main --config=configs/shapes_rl.py[:VARIANT][,smoke] --workdir=runs/rl
The default is ``image_elbo`` (the main job, chosen on the validation split in docs/estimators.md: reward-filtered
fine-tuning on MAR's own training ELBO, not the paper's estimator).
Variants (the ablation ladder of the paper, chain estimator, ``rl.fidelity='intended'``):
  grpo                  vanilla end-to-end GRPO: head trainable, one trajectory, no token selection
  frozen_head           + frozen diffusion head
  frozen_head_mte       + MTE on every token (S trajectories from the same AR latent)
  frozen_head_mte_topk  + MTE only on the top-k% uncertain tokens
  margrpo               + consistency-aware token selection (all stabilisers of the paper)
  paper                 MAR-GRPO as the official code computes it (``rl.fidelity='official'``, where MTE, top-k and
                        consistency act) with only the diffusion-window fix, strict pass as the reward, the
                        study's matched budget (12,800 rollout images) and EMA export
and, beyond the paper (each a named estimator of margrpo_jax/rl/estimators/, docs/estimators.md):
  focused               the policy term on the decoded tokens' own chains only (no MTE or consistency: the other
                        chains carry no reward signal), every step of the scored-step window, and common random
                        numbers inside a group (one generation order; diffusion noise varied only at the scored
                        AR steps). See docs/rl_signal.md.
  token_elbo            each committed token's head ELBO under its AR step's latent, q-MTE on the top-k tokens
  image_elbo            MAR's training ELBO of the tokenizer's re-encoding of the decoded image, better-than-group
                        images only (RAFT / RWR), no label drop; 32 prompts x 8 images per iteration, each
                        update scoring the 128 images of largest weight, until the rollouts' latent spread falls
                        to 0.8 of its start (``rl.diversity_floor``; at most 200 iterations); its EMA exported
  awm                   the same ELBO with signed advantages clipped to [-1, 1] and a KL anchor to the base
  nft                   DiffusionNFT: implicit positive / negative denoisers around the rollout policy
Estimator fixes on by default: ``rl.diffusion_window`` (no saturated first / near-deterministic last steps) and
the ``rl.official.*`` block, the official code's behaviours this project changes, each a switch
(``rl.official.mte_actual='keep'``: a decoded token keeps its own chain inside U; ``topk_scope='region'``;
``selection_chains='independent'``; ``sigma_grad``: sigma treated alike in the log-prob and the KL; ...).
``rl.fidelity='official'`` sets all of them (and the window) to the official code's values in one switch
(docs/algorithm.md section 14; deviation ids such as B1, A2 as in its section 13).
"""
import ml_collections

from margrpo_jax import config_files
from margrpo_jax.parallel import mesh
from margrpo_jax.rewards import registry
from margrpo_jax.rl import lora

VARIANTS = ("grpo", "frozen_head", "frozen_head_mte", "frozen_head_mte_topk", "margrpo", "paper", "focused",
            "token_elbo", "image_elbo", "awm", "nft")
FORWARD = ("image_elbo", "awm", "nft")  # estimators on the re-encoded image (no recorded chains)
MAIN = "image_elbo"  # the main job: the best estimator on the validation split (docs/estimators.md)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  parts = [a for a in (arg or MAIN).split(",") if a]
  variant = next((p for p in parts if p in VARIANTS), MAIN)
  unknown = [p for p in parts if p not in VARIANTS + ("smoke",)]
  if unknown:
    raise ValueError(f"unknown config arg {unknown[0]!r} for shapes_rl (variants: {', '.join(VARIANTS)}; "
                     "modifier: smoke)")
  c = ml_collections.ConfigDict()
  c.mode = "rl"
  c.variant = variant
  c.seed = 0
  c.checkpoint = ""  # base model export; '' = the shipped base
  c.init = ""        # 'random': start from a random-weight instance of config.model (the families' :random configs)
  c.tfds_dir = ""
  c.num_iters = 40
  c.parallel = mesh.config()  # device mesh, sharding rules, multi-host (margrpo_jax/parallel/mesh.py)
  c.export = dict(dtype="float32", dir="")  # mode=export: params-only checkpoint ('bfloat16' halves it)
  # Rollouts and eval sample exactly as the sample job does (configs/shapes_sample.py), so the gain measured here
  # is the one the sample job sees.
  c.sampling = config_files.load("shapes_sample").sampling
  c.rl = dict(
      fidelity="intended",        # 'intended' | 'official' (sets rl.official.* and every switch marked [official: ...])
      official_except="",         # with 'official': switches kept at their value here (comma-separated)
      prompt_file="",             # train prompts: '' = the shapes world (class labels for MAR), or a JSONL / text
                                  # prompt file (rl/prompts.py)
      # Weights of every registered reward (0 = computed and logged, not optimised); set any from the command line.
      rewards=dict(shapes_partial=1.0, shapes_strict=0.0, shapes_dense=0.0, jpeg_compressibility=0.0, brightness=0.0,
                   **{name: 0.0 for name in registry.LEARNED}),
      reward_norm="none",         # per-reward normalisation before summing: 'none' | 'std' | 'minmax'
      advantage="grpo",           # 'grpo' | 'drgrpo' | 'rloo'
      shuffle_advantages=False,   # control: advantages permuted inside each group (no reward signal, same seeds)
      positive_only=False,        # advantages clipped at 0: only images better than their group's mean are trained on
      diversity_bonus=0.0,        # lam > 0: r_i + lam r_i (d_i / mean_g d - 1), d_i the latent distance of image i to
                                  # the other images of its prompt (rl/advantages.py; against mode-seeking filters)
      diversity_floor=0.0,        # f in (0, 1): stop before num_iters once the rollouts' latent spread (mean of the
                                  # last 10 iterations) falls below f times its first 10 iterations' (a diversity
                                  # budget; jobs/rl.py:diversity_spent); 0 = run num_iters
      group_size=8, prompts_per_iter=4,
      rollout_prompts=0,          # > prompts_per_iter: prompts drawn per rollout, of whose groups the update keeps the
                                  # prompts_per_iter whose rewards vary most (DAPO's dynamic sampling: fewer
                                  # all-pass / all-fail groups, which carry no signal); 0 = prompts_per_iter
      num_ar_steps=2,             # AR steps scored per rollout (official: 12 of 64; 2 of 16 keeps CPU iterations short)
      num_diffusion_steps=4,      # diffusion steps scored per AR step (official: 10; 0 = every window step)
      diffusion_window="1:-3",    # scored steps from list positions lo:hi of the chain (x_n -> x_{n+1}, Python
                                  # slice bounds): drops t = 999 and j = 2, 1, 0 [official: ':', all steps]
      mte_seeds=4, topk_fraction=0.3, consistency=True, train_head=False,
      shared_order=False,         # the G images of a prompt share one generation order (variance reduction)
      shared_noise=False,         # ... and every diffusion noise except at the scored AR steps (implies shared_order)
      loss_tokens="unknown",      # 'unknown' (paper: every not-yet-known token) | 'decoded' (committed tokens only)
      estimator="chain",          # the image's log-likelihood (margrpo_jax/rl/estimators/): 'chain' (its recorded
                                  # transitions, the paper) | 'token_elbo' (each committed token's head ELBO, q-MTE) |
                                  # 'image_elbo' (MAR's training ELBO of the re-encoded image) | 'awm' | 'nft' |
                                  # 'elbo_hinge' (image_elbo + a hinge to the base on the worse images)
      adv_clip=0.0,               # > 0: advantages clipped to [-adv_clip, adv_clip] (AWM: 1)
      anchor="ref",               # awm / nft: the model the update is held to: 'ref' (the base) | 'ema' | 'rollout'
      nft_strength=1.0,           # nft: eps_+- = eps_old +- s (eps_theta - eps_old), s in (0, 1]
      elbo_rows=0,                # image_elbo / awm / nft: > 0 scores at most this many images per iteration, those
                                  # of largest |A| (positive-only weights leave about half at 0); 0 = all
      elbo_draws=1,               # image_elbo / awm / nft: independent draws of MAR's training loss per scored image
      rollout_policy="policy",    # the rollouts' sampler: 'policy' (on-policy, the current iterate) | 'base' (the
                                  # frozen base every iteration: rejection-sampling fine-tuning toward the base's
                                  # passing images, no self-training loop; docs/estimators.md)
      rollout_cfg_scale=0.0,      # > 0: the rollouts' guidance scale (else sampling.cfg_scale, which the job's own
                                  # eval and every reading of the export use)
      augment="none",             # image_elbo / awm / nft on the shapes world: 'shift' rolls each image the update trains
                                  # on to a random place that keeps all of it in the frame, before it is re-encoded
                                  # (the reward is unchanged; against the filter's layout collapse, rl/augment.py)
      rollout_temperature=0.0,    # > 0: the rollouts' diffusion-noise temperature (else sampling.temperature, which the
                                  # job's own eval and every reading of the export use)
      flow_noise_level=0.7,       # a flow head (NOVA): the rollouts' SDE noise level in (0, 1] (Flow-GRPO; 0 would be
                                  # NOVA's deterministic ODE, which has no log-prob)
      pretrain_mix=0.0,           # image_elbo / awm / nft on the shapes world: > 0 adds a quarter-batch of freshly
                                  # rendered train images, each weighted like an advantage of this value (PPO-ptx:
                                  # MAR's pretraining loss against self-training drift, docs/estimators.md)
      mar_objective=dict(mask_ratio="cosine", diffusion_batch_mul=4, label_drop=0.1),  # image_elbo / awm / nft: the
                                  # draws of MAR's training loss (label_drop: share of images scored unconditioned)
      ema_decay=0.0,              # > 0: export and evaluate an EMA of the policy (d ema + (1 - d) policy per update)
      export_interpolation=1.0,   # a in (0, 1]: export and evaluate theta_0 + a (theta - theta_0), the trained policy
                                  # (or its EMA) moved only part of the way from the base (WiSE-FT; keeps diversity)
      beta=0.01, clip_eps=0.2,    # [official: no clipping]
      channel_reduction="sum",    # per-token log-prob over channels: 'sum' (Harmon) | 'mean' (NOVA)
      # The official code's behaviours this project changes (docs/algorithm.md sections 13-14): each the value
      # used here, then the official one, which rl.fidelity='official' sets (rl.official_except keeps some).
      official=dict(
          ratio="rollout",            # [official: 'none', REINFORCE with exp(l - sg(l))]
          kl="gaussian",              # [official: 'official', exp(d) - d - 1 on the means]
          cfg_in_loss=True,           # [official: False]
          mask_after_step=False,      # [official: True, bug B1]
          mte_latent="step",          # [official: 'commit', A2]
          mte_commit_guided=False,    # with 'commit': guided MTE chains (CFG at cfg_scale) [official: True, Harmon]
          mte_actual="keep",          # a decoded token in U keeps its own chain | 'include' | [official: 'replace']
          diffusion_per_ar_step=False,  # the scored diffusion steps drawn per AR step [official NOVA: True]
          logp_bf16=False,            # per-token log-probs rounded through bfloat16 [official NOVA: True]
          topk_scope="region",        # U: top fraction of the loss region [official: 'all', known included]
          uncertainty_unit="token",   # U ranks tokens [official NOVA: 'pixel', latent pixels, a quarter token each]
          topk_random=0,              # random pixels added to U [official NOVA: 1]
          selection_chains="independent",  # U and consistency from chains of their own [official: 'scored']
          sigma_grad=True,            # sigma(z) differentiable in log-prob and KL alike [official: False, detached]
          sequential_updates=False,   # [official: True, one optimizer step per scored AR step (B8)]
      ),
      num_inner=1,                # passes over each rollout's batch (PPO epochs; the ratio is 1 only in the first)
      num_minibatches=1,          # optimizer steps per pass, each on consecutive blocks of the iteration's images
      microbatch=0,               # > 0: an optimizer step's images scored this many at a time, gradients summed
                                  # (exact; the activation memory of one microbatch); 0 = all at once
      remat=False,                # recompute each scored AR step, each block, each diffusion step in the backward pass
                                  # (memory; real sizes)
      remat_ar_steps=True,        # with remat: False drops the checkpoint around each whole scored AR step (its blocks
                                  # and head steps still recomputed): the block inputs of all M steps held instead of
                                  # one step's, one backbone forward fewer (an update 1.32x faster, docs/reference.md)
      compute_dtype="float32",    # 'bfloat16': every layer but the diffusion head computes in bf16 (rollout, update
                                  # and eval); params, grads, optimizer state and log-probs stay float32
                                  # (models/precision.py)
      frozen_dtype="float32",     # 'bfloat16': the parts no optimizer sees (the frozen head, the tokenizer side, the
                                  # LoRA base) and the reference policy stored in bf16, half their bytes; the policy
                                  # starts at the same rounded values; layers still compute in float32 (rl/step.py)
      # LoRA (margrpo_jax/rl/lora.py): rank > 0 trains only W' = W + (alpha / rank) A B on the targeted kernels of
      # the trained components (A random, B zero: starts at the base); the base, the reference, is frozen and the
      # export merges the adapters into ordinary weights. rank 0 = full fine-tuning.
      lora=dict(rank=0,
                alpha=0.0,        # 0 = rank (scale 1)
                targets=lora.DEFAULT_TARGETS),  # comma-separated regexes over '/'-joined parameter paths, e.g.
                                  # backbone/encoder_blocks/0/attn/qkv/kernel; default: every transformer block's
                                  # attention and MLP kernels (not embeddings, projections or the head)
  )
  c.rewards = registry.settings_config()  # learned rewards: checkpoint, vocab and options per name
  c.optim = dict(lr=3e-5, warmup_steps=0, decay="constant", final_lr_frac=1.0, b1=0.9, b2=0.999, eps=1e-8,
                 weight_decay=0.0, grad_clip=1.0)
  c.eval = dict(num_prompts=512, batch_size=64, seed=0,  # 512 = the whole eval split (strict pass se ~0.022)
                prompt_file="")  # eval prompts: '' = the shapes eval split, or those of rl.prompt_file
  c.save = dict(every=5, keep=3)  # train-state checkpoints (Orbax, async) every N iterations
  c.log_images_every = 10         # TensorBoard grid of the rollouts every N iterations
  if variant not in ("margrpo", "paper"):
    c.rl.consistency = False
  if variant in ("grpo", "frozen_head") or variant in FORWARD:
    c.rl.mte_seeds = 0
  if variant == "frozen_head_mte":
    c.rl.topk_fraction = 1.0
  if variant == "grpo":
    c.rl.train_head = True
  if variant == "focused":  # beyond the paper: only terms that carry reward signal, common random numbers
    c.rl.update(loss_tokens="decoded", mte_seeds=0, num_diffusion_steps=0, shared_noise=True)
  if variant in ("paper", "token_elbo") + FORWARD:  # the study's matched budget: 12,800 images, strict pass, EMA
    c.num_iters = 200
    c.rl.update(prompts_per_iter=8, group_size=8, ema_decay=0.95)
    c.rl.rewards.update(shapes_partial=0.0, shapes_strict=1.0)
    c.save.every = 25
  if variant == "paper":
    c.rl.update(fidelity="official", official_except="diffusion_window")  # only the diffusion-window fix
  if variant == "token_elbo":
    c.optim.lr = 1e-4
    c.rl.update(estimator="token_elbo", loss_tokens="decoded", num_diffusion_steps=0)
  if variant in FORWARD:
    c.optim.lr = 1e-4
    c.rl.update(estimator=variant, beta=0.0)
    c.rl.mar_objective.label_drop = 0.0  # no gradient into the unconditional branch (docs/estimators.md)
  if variant == "image_elbo":  # the main job: 32 prompts x 8 images per iteration, the 128 heaviest scored, until the
    c.num_iters = 200            # rollouts' latent spread falls to 0.8 of its start (about 140-160 iterations)
    c.rl.update(positive_only=True, prompts_per_iter=32, elbo_rows=128, diversity_floor=0.8)
  if variant == "awm":
    c.rl.update(adv_clip=1.0, beta=1.0, anchor="ref")
  if variant == "nft":
    c.rl.update(adv_clip=1.0, anchor="rollout", nft_strength=1.0)
  if "smoke" in parts:
    c.num_iters = 3
    c.sampling.update(num_steps=4, diffusion_steps="5")
    c.rl.update(group_size=2, prompts_per_iter=2, num_ar_steps=2,
                num_diffusion_steps=min(c.rl.num_diffusion_steps, 2), diffusion_window="1:-1",
                mte_seeds=min(c.rl.mte_seeds, 2))
    c.eval.update(num_prompts=8, batch_size=8)
    c.save.every = 1
  return c

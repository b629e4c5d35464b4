r"""``chain``: the paper's estimator. A token's log-likelihood is that of its recorded reverse-diffusion
transitions under the frozen head given the AR latent recomputed with gradients (``rl/loss.py``):

    grad = sum over scored AR steps i, scored diffusion steps j and tokens l in the loss region M' of
           A grad log N(x_{j-1} | mu_head(x_j, j, z_i(theta)), sigma_j^2)

with MTE (the mean over ``S`` chains drawn from the same latent on the top-k% uncertain tokens), the
consistency-aware selection ``M'`` and a KL to the frozen reference, PPO-clipped against the rollout's log-probs
when one rollout feeds several optimizer steps. The batch is built from the recorded rollout by ``rl/batch.py``
(``BatchConfig.logp = 'chain'``); ``rl.fidelity='official'`` reproduces the official code's estimator.
"""
NAME = "chain"
READS_CHAINS = True
REENCODES = False
BATCH_LOGP = "chain"

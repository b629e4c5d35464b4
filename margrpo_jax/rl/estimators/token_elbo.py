r"""``token_elbo``: each committed token's log-likelihood as the frozen head's denoising ELBO of its final value
``x_0`` given the AR latent of the step that decoded it, with q-MTE on the uncertain tokens:

    l_i(x_0) = -1/2 E_{j, eps} |eps_head(sqrt(abar_j) x_0 + sqrt(1 - abar_j) eps, j, z_i(theta)) - eps|^2
    grad     = sum over scored AR steps i and tokens l in the loss region of A grad l_i(x_0[l])

estimated at ``rl.num_diffusion_steps`` noise levels ``j`` of the window with one ``eps`` per level, and, on the
top-k% uncertain tokens ``U`` (ranked by the spread of ``S`` chains drawn from the step latent, as MTE ranks
them), the mean over ``S`` forward-process draws ``eps^(s)`` (q-MTE): the paper's expectation over ``S``
trajectories, taken over trajectories that end at the committed token (the Rao-Blackwellised score) instead of
model chains that end elsewhere and carry no reward signal. With ``rl.loss_tokens='decoded'`` the region is the
tokens decoded at step ``i`` (the exact factorisation of the image's likelihood); with 'unknown' every
not-yet-known token's final value is scored under ``z_i`` (a pseudo-likelihood, as MAR trains). The batch is built
by ``rl/batch.py`` (``BatchConfig.logp = 'elbo'``), the surrogate and KL by ``rl/loss.py``.
"""
NAME = "token_elbo"
READS_CHAINS = True
REENCODES = False
BATCH_LOGP = "elbo"

"""MAR-GRPO: advantages, token selection (uncertainty top-k, consistency), the loss and the RL loop."""

"""A tempering plug-in outside tempering's source: an environment (`env:ReverseEnv`), a reward function
(`rewards:one_line`) and a policy loss (`loss:hard_clip_loss`), each named in `plugin.yaml` by import path."""

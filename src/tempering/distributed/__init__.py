"""Rollouts as units of work that run anywhere: the schedule (which policy version samples which step, the
shards a step is cut into, their seeds), the pool that runs them (in this process, or on Ray actors), the
weights that travel to the workers and the canary that checks they arrived.

`schedule` and `pool` need no Ray; `ray_pool` is imported only with `distributed.backend: ray`."""

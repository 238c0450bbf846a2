"""Tasks: files, the built-in generator, and resumable sampling."""

from tempering.data.generators import DOMAINS, generate_tasks
from tempering.data.sampler import MixtureSampler, TaskSampler
from tempering.data.tasks import function_key, hold_out_functions, load_tasks, save_tasks, split_stages

__all__ = [
    "DOMAINS",
    "MixtureSampler",
    "TaskSampler",
    "generate_tasks",
    "load_tasks",
    "save_tasks",
    "split_stages",
    "hold_out_functions",
    "function_key",
]

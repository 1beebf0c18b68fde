"""The `train:` config section."""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import ClassVar, Any, Literal

from infra.configtools import join, require
from trainers.models.config import Family


@dataclass
class OptimConfig:
    name: Literal["adamw", "adafactor"] = "adamw"  # the optimizer (adamw, or the paper's adafactor)
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.1      # decoupled, on weight matrices only (AdamW: x lr; adafactor: x schedule, paper 1e-4)
    beta1: float = 0.9             # adamw beta1; adafactor: momentum
    beta2: float = 0.999           # adamw beta2; adafactor: beta2_cap
    warmup_steps: int = 100  # linear warmup steps before the schedule's decay
    schedule: Literal["cosine", "linear"] = "cosine"   # after warmup: cosine to 0, or linear to 0 (ClipCap's)
    clip: float = 1.0              # gradient norm clipping (0: off)
    check_recipe: bool = True      # refuse a weight decay far from every published recipe (false: allow)

    def validate(self, prefix: str) -> None:
        require(self.lr > 0, join(prefix, "lr"), f"must be > 0, got {self.lr}")
        require(self.weight_decay >= 0, join(prefix, "weight_decay"), "must be >= 0")
        # The two optimisers read weight_decay differently: big_vision's Adafactor decays by wd x schedule
        # (the paper: 1e-4), AdamW by wd x lr (CLIP, open_clip: 0.1-0.2 at lr ~5e-4, i.e. ~1e-4 per step).
        per_step = self.weight_decay * (1.0 if self.name == "adafactor" else self.lr)
        require(not self.check_recipe or per_step <= 1e-2, join(prefix, "weight_decay"),
                f"{self.weight_decay} with {self.name} decays weights by {per_step:g} of themselves per step, "
                f"{per_step / 1e-4:.0f}x the published recipes' ~1e-4"
                + (" (Adafactor's decay is not multiplied by the learning rate: the paper uses 1e-4)"
                   if self.name == "adafactor" else "") + f"; lower it, or set {join(prefix, 'check_recipe')}=false")
        require(self.warmup_steps >= 0, join(prefix, "warmup_steps"), "must be >= 0")
        require(self.clip >= 0, join(prefix, "clip"), "must be >= 0")


# Published recipes, applied under what the config sets itself (pipeline/config.py: load_config).
RECIPES = {
    # Tschannen et al. 2023 (big_vision): Adafactor with momentum 0.9, beta2 cap 0.999, lr 1e-3, decoupled
    # decay 1e-4 on every kernel, cosine with linear warmup (10k of 650k steps at batch 8k)
    "paper": {"optim": {"name": "adafactor", "lr": 1e-3, "weight_decay": 1e-4, "beta1": 0.9, "beta2": 0.999,
                        "schedule": "cosine", "clip": 1.0}},
    # Mokady et al. 2021: AdamW (transformers', no weight decay), lr 2e-5, 5,000 warmup steps, then
    # linear decay; batch 40; no gradient clipping
    "clipcap": {"global_batch": 40, "optim": {"name": "adamw", "lr": 2e-5, "warmup_steps": 5000, "schedule": "linear",
                                              "weight_decay": 0.0, "clip": 0.0}},
}


def with_recipe(train: dict) -> dict:
    """train: the raw `train:` mapping -> the recipe's values, overridden by the mapping's own."""
    name = train.get("recipe")
    if name not in RECIPES:
        return train
    base = RECIPES[name]
    return {**base, **train, "optim": {**base.get("optim", {}), **(train.get("optim") or {})}}


@dataclass
class TrainConfig:
    # how the job runs, not what it trains: changing one resumes from the last checkpoint (kept out
    # of the stage's fingerprint). `steps` too: more steps continue the run where it stopped (the
    # train stage reruns a finished job that has fewer steps than asked: TrainStage.complete)
    HOW: ClassVar[tuple] = ("num_workers", "min_workers", "loader_workers", "checkpoint_every", "keep_checkpoints", "max_failures",
                            "sample_every", "log_every", "system_metrics_every", "eval_every", "experiment", "steps",
                            "activation_checkpointing", "compile")
    SIGNED: ClassVar[tuple] = ("max_failures",)     # -1: any number of failures
    model: Family = "cappa"  # the family to pretrain: cap, cappa, clip, siglip, coca, clipcap
    size: Literal["tiny", "s16", "m16", "b16", "l14"] = "tiny"  # the family's size (tiny, S/16, B/16, L/14 ...): `capline models` lists them
    model_args: dict[str, Any] = field(default_factory=dict)   # any ModelConfig field, e.g. {width: 96}
    image_size: int | None = None  # null: 64 for size tiny, 224 (the paper's) for the ViT sizes
    max_len: int = 64              # caption tokens with EOS, as the paper's sizes use
    steps: int = 0                 # 0: the train stage trains nothing
    global_batch: int = 64         # independent of the number of workers
    micro_batch: int | None = None  # per worker and step of accumulation (default: global / workers)
    num_workers: int = 2  # Ray Train workers (data-parallel)
    min_workers: int = 0  # elastic: start (and go on after a lost node) with as few as this, up to num_workers (0: exactly num_workers)
    loader_workers: int = 1        # background loader processes per training worker
    use_gpu: bool = False  # train on GPUs (one a worker)
    shuffle_buffer: int = 10_000   # samples a worker's loader shuffles together (1: the shards' order); epochs stay exact
    resampled: bool = False        # draw each epoch's shards with replacement (open_clip's --dataset-resampled)
    checkpoint_every: int = 50  # steps between checkpoints (a stopped run resumes from the last)
    keep_checkpoints: int = 2  # checkpoints kept on disk
    max_failures: int = 2  # worker failures Ray Train recovers from before the run fails (-1: any number)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 on GPUs, fp32 on CPUs; fp16 scales the loss
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass (less memory)
    parallel: Literal["ddp", "fsdp"] = "ddp"  # ddp: a whole model per worker; fsdp: sharded over them (FSDP2, for L/14+)
    compile: bool = False          # torch.compile the model (the first steps compile; needs a C++ compiler on CPUs)
    sample_every: int = 100        # captioning models: log a few generated captions every N steps
    log_every: int = 10            # steps between MLflow writes of the metrics (every step is logged)
    eval_every: int = 0            # steps between evaluations during training (few-shot, captioning; on a checkpoint, beside training; 0: off)
    system_metrics_every: float = 10.0  # seconds between each node's CPU, memory, disk, network, GPU samples in MLflow (0: off)
    image_encoder: str | None = None  # clipcap: a capline checkpoint whose encoder stays frozen
    lm_checkpoint: str | None = None  # clipcap: a trained ClipCap checkpoint whose LM (lm.*) to start from
    lm_path: str | None = None     # clipcap: a local Hugging Face causal LM folder (GPT-2 family) as the LM
    recipe: Literal["clipcap", "paper"] | None = None  # a published recipe's optimiser and batch under your values
    experiment: str = "capline"  # the MLflow experiment runs are logged to
    optim: OptimConfig = field(default_factory=OptimConfig)

    def validate(self, prefix: str) -> None:
        require(self.steps >= 0, join(prefix, "steps"), f"must be >= 0, got {self.steps}")
        require(self.num_workers >= 1, join(prefix, "num_workers"), "must be >= 1")
        require(self.global_batch >= 1, join(prefix, "global_batch"), "must be >= 1")
        require(0 <= self.min_workers <= self.num_workers, join(prefix, "min_workers"),
                f"must be 0 (a fixed train.num_workers) or 1..{self.num_workers} (train.num_workers), got {self.min_workers}")
        # the global batch is the recipe's: whatever number of workers the job runs on, it is split evenly
        uneven = [w for w in self.worker_counts if self.global_batch % w]
        require(not uneven, join(prefix, "global_batch"),
                f"{self.global_batch} is not divisible by {uneven[0] if uneven else 0} workers"
                + (f" (train.min_workers {self.min_workers} to num_workers {self.num_workers}: choose a global batch "
                   f"divisible by {math.lcm(*self.worker_counts)}, or narrow the range)" if self.min_workers else
                   "; the global batch is split evenly over train.num_workers"))
        if self.micro_batch is not None and not uneven:
            bad = [self.global_batch // w for w in self.worker_counts if (self.global_batch // w) % self.micro_batch]
            require(self.micro_batch >= 1 and not bad, join(prefix, "micro_batch"),
                    f"must divide the per-worker batch {bad[0] if bad else self.micro_batch}")
        require(self.shuffle_buffer >= 1, join(prefix, "shuffle_buffer"), "must be >= 1 (1: no shuffling)")
        require(self.loader_workers >= 0, join(prefix, "loader_workers"), "must be >= 0")
        require(self.checkpoint_every >= 1, join(prefix, "checkpoint_every"), "must be >= 1")
        require(self.log_every >= 1, join(prefix, "log_every"), "must be >= 1 (steps between MLflow writes)")
        require(self.eval_every >= 0 and self.eval_every % self.checkpoint_every == 0, join(prefix, "eval_every"),
                f"must be 0 (off) or a multiple of train.checkpoint_every ({self.checkpoint_every}): it evaluates a checkpoint")
        require(not self.eval_every or self.model != "clipcap", join(prefix, "eval_every"),
                "clipcap is evaluated at the end only (its checkpoint needs its frozen encoder beside it); set 0")
        require(self.system_metrics_every == 0 or self.system_metrics_every >= 1, join(prefix, "system_metrics_every"),
                "must be 0 (off) or >= 1 (seconds between samples)")
        require(self.keep_checkpoints >= 1, join(prefix, "keep_checkpoints"), "must be >= 1")
        require(self.max_failures >= -1, join(prefix, "max_failures"), "must be >= 0, or -1 for any number of failures")
        require(self.max_len >= 4, join(prefix, "max_len"), "must be >= 4")
        require(self.image_size is None or 16 <= self.image_size <= 1024, join(prefix, "image_size"),
                f"must be 16..1024 pixels or null, got {self.image_size}")
        if self.model == "clipcap":
            require(bool(self.image_encoder), join(prefix, "image_encoder"),
                    "clipcap trains on a frozen image encoder: name a capline checkpoint directory")
            frozen = self.model_args.get("lm_frozen", self.model_args.get("mapper") == "transformer")
            require(not frozen or bool(self.lm_checkpoint or self.lm_path), join(prefix, "lm_path"),
                    "clipcap with a frozen LM (the transformer mapper's default): name a local Hugging Face GPT-2 "
                    "folder (train.lm_path) or a trained ClipCap checkpoint (train.lm_checkpoint) to take it from (a "
                    "frozen, freshly initialised LM only outputs zeros), or use mapper: mlp")
            require(not (self.lm_path and self.lm_checkpoint), join(prefix, "lm_path"),
                    "name one language model: train.lm_path (a Hugging Face folder) or train.lm_checkpoint, not both")
        else:
            require(not self.lm_path, join(prefix, "lm_path"), f"only clipcap has a language model to load, not {self.model}")

    @property
    def input_size(self) -> int:
        """The image side the model reads: image_size, else the size's own (a B/16 at 64 pixels would
        see 4x4 patches)."""
        return self.image_size or (64 if self.size == "tiny" else 224)

    @property
    def worker_counts(self) -> range:
        """The numbers of workers the job may run on (one unless elastic)."""
        return range(self.min_workers or self.num_workers, self.num_workers + 1)

    @property
    def scaling(self) -> int | tuple[int, int]:
        """Ray Train's num_workers: a (min, max) pair makes the worker group elastic."""
        return (self.min_workers, self.num_workers) if self.min_workers else self.num_workers

    def per_worker_batch(self, world: int) -> int:
        return self.global_batch // world

    def accumulation(self, world: int) -> int:
        return self.per_worker_batch(world) // (self.micro_batch or self.per_worker_batch(world))

"""The Ray Train loop, one copy per worker.

Each step: `accumulation` micro-batches of the worker's share of the global batch, gradients
averaged across workers by DDP, clipped, one optimiser and schedule step. Every `checkpoint_every`
steps (and at the end) every worker calls ray.train.report the same number of times; rank 0 also
hands over a checkpoint (weights, optimiser, schedule, step, every worker's loader position and
random state), which Ray Train uploads in the background while training goes on, and flushes its
buffered MLflow metrics, so a restarted run repeats no step in MLflow.
A NaN or infinite loss stops the run, naming the steps since the last finite one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import torch


def _save(path: Path, weights: dict, opt_state: dict, sched, step: int, loader_states: list, gen_states: list,
          loss: float = float("nan"), steps: int | None = None, scaler: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(path / "model.safetensors"))
    torch.save({"opt": opt_state, "sched": sched.state_dict(), "gens": gen_states, "scaler": scaler or {}},
               path / "train_state.pt")
    (path / "meta.json").write_text(json.dumps({"step": step, "steps": steps, "loader": loader_states, "loss": loss}))


@dataclass
class WorkerJob:
    """What every training worker gets, typed end to end (Ray Train hands it over pickled)."""
    train: Any                    # TrainConfig
    model: Any                    # ModelConfig
    seed: int
    shards: list                  # paths or URIs of the final shards
    tokenizer: bytes              # spm.model
    storage: Any                  # the run folder's Storage
    out: str                      # run-relative folder of this training's outputs
    image_encoder: str | None     # ClipCap's frozen encoder, run-relative
    lm_checkpoint: str | None
    hf_lm: str | None             # ClipCap's Hugging Face LM folder, run-relative (its tokenizer is used)
    mlflow_uri: str
    run_id: str


SCRATCH = "capline-train-"


def prune_scratch(tmp: Path | None = None) -> list[Path]:
    """Remove the scratch folders of workers that are gone (a worker killed hard never ran its own
    cleanup): named for their process id, removed when no such process runs. -> what was removed."""
    import shutil

    import psutil

    gone = []
    for d in Path(tmp or tempfile.gettempdir()).glob(f"{SCRATCH}*-*"):
        pid = d.name[len(SCRATCH):].split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _system_metrics(c: WorkerJob, every: float, ctx):
    """MLflow's system-metrics sampler (CPU, memory, disk, network; GPUs where pynvml sees them), one
    per node, as `system/node<N>/...` on the training run; resumed runs go on from its last step. A
    sampler that cannot start (no MLflow server yet) costs a line, never the training."""
    if not every or not c.run_id or ctx.get_local_rank() != 0:
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(c.run_id, sampling_interval=every, resume_logging=True,
                                       node_id=f"node{ctx.get_node_rank()}", tracking_uri=c.mlflow_uri)
        monitor.start()
        return monitor
    except Exception as err:  # noqa: BLE001 - tracking is not the training
        print(f"mlflow: no system metrics from node {ctx.get_node_rank()} ({type(err).__name__}: {err})", flush=True)
        return None


def train_loop_per_worker(config: dict) -> None:
    """A Ray Train worker's loop, in a scratch folder of its own that is removed however the loop
    ends (every run left ~5 MB in /tmp per worker: the tokenizer, the saved model and export), and
    at the next start if the worker was killed before it could."""
    import shutil

    prune_scratch()
    scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH}{os.getpid()}-"))
    try:
        _train(config, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _train(config: dict, scratch: Path) -> None:
    import ray.train
    import ray.train.torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from .scaling import Precision, average_replicated, checkpoint_activations, full_states, load_optimizer, shard
    from .data import LoaderState, ShardStream, as_input, make_loader, next_state
    from .tokenizer import open_tokenizer
    from .models import ModelConfig
    from .optim import build_optimizer, build_schedule
    from .tasks import LossModule, make_task
    from infra.tracking import MetricBuffer, client
    from .train_config import TrainConfig

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    c: WorkerJob = config["job"]
    tc: TrainConfig = c.train
    mc: ModelConfig = c.model
    # every file goes to the run folder's storage: this worker may be on a node with no disk in common
    storage, out = c.storage, c.out
    storage.write_bytes(f"{out}/_pids/rank{rank}", str(os.getpid()).encode())
    # which Ray node each rank ran on, for the stage's stats
    storage.write_bytes(f"{out}/_nodes/rank{rank}", ray.get_runtime_context().get_node_id().encode())
    tokenizer = scratch / "spm.model"   # SentencePiece and the loader processes want a file
    tokenizer.write_bytes(c.tokenizer)
    torch.manual_seed(c.seed * 1000 + rank)
    gen = torch.Generator().manual_seed(c.seed * 1000 + rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    if c.hf_lm:     # the LM's own tokenizer replaces the run's SentencePiece model
        import dataclasses

        tokenizer = storage.local_dir(c.hf_lm)
        mc = dataclasses.replace(mc, hf_lm=str(tokenizer))
    encoder = c.image_encoder   # ClipCap's frozen encoder, from the run folder's storage
    lm = c.lm_checkpoint
    task = make_task(mc, str(storage.local_dir(encoder)) if encoder else None,
                     str(storage.local_dir(lm)) if lm else None)
    with torch.random.fork_rng():
        torch.manual_seed(c.seed * 1000)    # one initialisation on every worker (FSDP shards it as it is)
        model = task.build()
    model.train()       # a pretrained LM loads in eval mode: training starts in train mode (dropout), not after the first sample log
    step, state, ts = 0, LoaderState(), None
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            d = Path(d)
            model.load_state_dict(load_file(str(d / "model.safetensors")), strict=False)
            ts = torch.load(d / "train_state.pt", weights_only=True)
            meta = json.loads((d / "meta.json").read_text())
            step, saved = meta["step"], meta["loader"]
            resumed_loss = meta.get("loss", float("nan"))
            if len(saved) == world:     # the same workers: each goes on exactly where it stopped
                gen.set_state(ts["gens"][rank])
                state = LoaderState(**saved[rank])
            else:   # train.num_workers changed (a node lost, one added): each share of the data is new
                state = LoaderState(epoch=1 + max(s["epoch"] for s in saved))
                gen.manual_seed(c.seed * 1000 + rank + 7919 * step)
                if rank == 0:
                    print(f"train: resuming step {step} on {world} workers (the checkpoint's job had {len(saved)}): "
                          f"weights, optimiser and schedule restored; the data order starts a new pass "
                          f"(epoch {state.epoch})", flush=True)
            if rank == 0 and meta.get("steps") not in (None, tc.steps):
                print(f"train: train.steps {meta['steps']} -> {tc.steps}: resuming at step {step}; the learning-rate "
                      f"schedule is now laid over {tc.steps} steps, so its shape from step {step} on differs from "
                      "the run's so far", flush=True)
        storage.write_bytes(f"{out}/_resumed_from_rank{rank}", f"resumed from step {step}\n".encode())
    if rank == 0 and tc.min_workers:
        print(f"train: {world} of up to {tc.num_workers} workers (train.min_workers {tc.min_workers}), "
              f"{tc.per_worker_batch(world)} samples each a step", flush=True)
    device = ray.train.torch.get_device()
    if tc.activation_checkpointing:
        checkpoint_activations(model)
    fsdp = tc.parallel == "fsdp"
    wrapped = shard(LossModule(model), device) if fsdp else ray.train.torch.prepare_model(LossModule(model))
    if tc.compile:
        wrapped = torch.compile(wrapped)
    # built on the parameters as wrapped: FSDP replaces each with its shard
    opt = build_optimizer(model, tc.optim)
    sched = build_schedule(opt, tc.optim, tc.steps)
    precision = Precision(tc.precision, device)
    if ts is not None:
        load_optimizer(model, opt, ts["opt"], fsdp)
        sched.load_state_dict(ts["sched"])
        precision.load_state_dict(ts.get("scaler", {}))
    if fsdp and rank == 0 and task.writes and tc.sample_every:
        print("train: train.parallel fsdp writes no sample captions during training (a sharded model decodes "
              "only on every worker at once); the final model's evaluation writes them", flush=True)
    from .families import spec as family_spec

    stream = ShardStream(c.shards, str(tokenizer), tc.micro_batch or tc.per_worker_batch(world),
                         mc.image_size, mc.max_len, c.seed, rank, world, state,
                         eos=family_spec(mc.family).stop_text is None, shuffle=tc.shuffle_buffer,
                         resampled=tc.resampled)
    batches = iter(make_loader(stream, tc.loader_workers, pin=device.type == "cuda"))
    sp = open_tokenizer(tokenizer)
    buffer = MetricBuffer(c.mlflow_uri, c.run_id, log=lambda m: print(m, flush=True)) if rank == 0 else None
    monitor = _system_metrics(c, tc.system_metrics_every, ctx)
    fixed = None
    # a job resumed from its last checkpoint (killed after it, before final.json) runs no step here
    total = mean_loss = resumed_loss if ckpt else float("nan")
    last_finite, t_last = step, time.perf_counter()
    t_progress, p_step = t_last, step
    wait_total = busy_total = 0.0
    while step < tc.steps:
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(tc.accumulation(world))]
        t1 = time.perf_counter()
        if fixed is None and task.writes and rank == 0 and not fsdp:
            fixed = micro[0]["images"][:4]
        total, parts, tokens = 0.0, {}, 0
        for i, b in enumerate(micro):
            sync = i == len(micro) - 1 or not hasattr(wrapped, "no_sync")
            with precision.autocast(), (wrapped.no_sync() if not sync else contextlib.nullcontext()):
                loss, metrics = wrapped(as_input(b["images"].to(device, non_blocking=True)),
                                        b["labels"].to(device, non_blocking=True), generator=gen)
                precision.backward(loss / len(micro))
            total += loss.item() / len(micro)
            for k, v in metrics.items():
                parts[k] = parts.get(k, 0.0) + float(v) / len(micro)
            tokens += task.tokens(b["labels"])
        if not torch.isfinite(torch.tensor(total)):
            raise RuntimeError(f"training loss became {total} at step {step + 1} (last finite loss at step "
                               f"{last_finite}); stopping: lower train.optim.lr or check the data")
        last_finite = step + 1
        # the gradient norm is logged every step: clipping at inf measures it without changing it
        if fsdp:
            average_replicated(wrapped)
        precision.unscale(opt)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.optim.clip or float("inf")))
        precision.step(opt)
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        state = next_state(micro[-1])
        t2 = time.perf_counter()
        wait_total += t1 - t0
        busy_total += t2 - t1
        mean_loss = total
        if world > 1:   # every rank's loss, not rank 0's alone (one scalar beside DDP's gradients)
            both = torch.tensor([total], dtype=torch.float64, device=device)
            dist.all_reduce(both)
            mean_loss = float(both.item()) / world
        if buffer is not None:
            dt = max(t2 - t_last, 1e-9)
            gpu = ({"gpu_memory_gb": torch.cuda.max_memory_allocated(device) / 2 ** 30} if device.type == "cuda" else {})
            buffer.add(step, {"loss": mean_loss, "loss_rank0": total, **parts, "lr": sched.get_last_lr()[0],
                              "grad_norm": grad_norm, "examples_per_s_per_worker": tc.global_batch / world / dt,
                              "data_wait_s": t1 - t0, "compute_s": t2 - t1, **gpu,
                              "examples_per_s": tc.global_batch / dt, "tokens_per_s": tokens * world / dt,
                              "data_wait_fraction": wait_total / max(wait_total + busy_total, 1e-9)})
            if step % tc.log_every == 0:   # MLflow sees the run as it goes, not at checkpoints alone
                buffer.flush()
        t_last = t2
        if rank == 0 and (t2 - t_progress >= 2.0 or step == tc.steps):
            # the driver's progress bar reads this (any node writes to the run folder's storage)
            per_s = (step - p_step) / max(t2 - t_progress, 1e-9)
            storage.write_json(f"{out}/progress.json", {"step": step, "steps": tc.steps, "loss": mean_loss,
                                                         "steps_per_s": per_s, "examples_per_s": tc.global_batch * per_s})
            t_progress, p_step = t2, step
        if buffer is not None and task.writes and tc.sample_every and step % tc.sample_every == 0 and fixed is not None:
            caps = task.samples(model, as_input(fixed.to(device)), sp)
            try:
                client(c.mlflow_uri).log_text(c.run_id, "\n".join(caps), f"samples/step_{step:06d}.txt")
            except Exception as err:  # noqa: BLE001 - MLflow down: keep the samples beside the model
                storage.write_bytes(f"{out}/samples/step_{step:06d}.txt", "\n".join(caps).encode())
                print(f"mlflow: sample captions of step {step} not logged ({type(err).__name__}); "
                      f"saved to {storage.uri(out + '/samples')}", flush=True)
        if step % tc.checkpoint_every == 0 or step == tc.steps:
            states = [state.to_dict()]
            gens = [gen.get_state()]
            if world > 1:
                states, gens = [None] * world, [None] * world
                dist.all_gather_object(states, state.to_dict())
                dist.all_gather_object(gens, gen.get_state())
            # FSDP: every worker, for the gathers; DDP: rank 0 alone holds what it saves
            weights, opt_state = full_states(model, opt, fsdp) if fsdp or rank == 0 else (None, None)
            checkpoint = None
            if rank == 0:
                # written here, uploaded to the run folder's storage by Ray Train in the background
                # (ASYNC): the workers stall for a local write, not for the bucket (a B/16 with AdamW
                # is ~2.3 GB). Not in `scratch`: an upload may outlive this loop; Ray deletes the folder
                # once it is uploaded, prune_scratch if the worker is killed first.
                d = Path(tempfile.mkdtemp(prefix=f"{SCRATCH}{os.getpid()}-ckpt{step}-"))
                _save(d, weights, opt_state, sched, step, states, gens, mean_loss, tc.steps, precision.state_dict())
                checkpoint = ray.train.Checkpoint.from_directory(str(d))
                buffer.flush()
            # train.eval_every: Ray Train evaluates this checkpoint in a task of its own (eval_during.py)
            due = bool(tc.eval_every) and step % tc.eval_every == 0 and checkpoint is not None
            ray.train.report({"step": step, "loss": mean_loss}, checkpoint=checkpoint,
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC, validation=due)
    if monitor is not None:
        monitor.finish()
    if fsdp:    # the whole model on rank 0, as a plain module, for saving and export
        weights, _ = full_states(model, None, fsdp)
        if rank == 0:
            model = task.build()
            model.load_state_dict(weights, strict=False)
    if rank == 0:
        from .export import export_encoder
        from .models.checkpoint import save_model

        saved = save_model(model, task.model_cfg, scratch / "model")
        storage.put_dir(f"{out}/model", saved)
        if (saved / "hf_lm").is_dir():     # a Hugging Face LM's config and tokenizer (put_dir is flat)
            storage.put_dir(f"{out}/model/hf_lm", saved / "hf_lm")
        storage.put_dir(f"{out}/export", export_encoder(model, task.model_cfg, scratch / "export"))
        unlogged = buffer.close(scratch / "unlogged_metrics.jsonl")
        if (scratch / "unlogged_metrics.jsonl").is_file():
            spill = f"{out}/unlogged_metrics.jsonl"
            old = storage.read_bytes(spill) if storage.exists(spill) else b""
            storage.write_bytes(spill, old + (scratch / "unlogged_metrics.jsonl").read_bytes())
            unlogged["file"] = storage.uri(spill)
        storage.write_json(f"{out}/final.json", {"step": step, "loss": mean_loss, "mlflow": unlogged, "workers": world,
                                                 "data_wait_fraction": wait_total / max(wait_total + busy_total, 1e-9)})



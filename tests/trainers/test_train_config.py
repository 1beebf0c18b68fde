

def test_how_the_training_job_runs_is_out_of_the_train_stages_fingerprint():
    """A rerun with only max_failures changed (2 -> 5) started from step 0: every train.* setting was
    in the fingerprint. How-settings leave it as it was (the job resumes); what decides changes it."""
    from pipeline.config import load_config
    from stages.train import TrainStage

    def fp(*sets):
        return TrainStage().fingerprint(load_config(None, list(sets)))

    same = fp()
    for how in ("train.max_failures=5", "train.num_workers=4", "train.loader_workers=3", "train.checkpoint_every=7",
                "train.keep_checkpoints=5", "train.sample_every=3", "train.log_every=1", "train.steps=900"):
        assert fp(how) == same, how
    for decides in ("train.model=clip", "train.global_batch=128", "train.optim.lr=0.01", "train.size=s16"):
        assert fp(decides) != same, decides
    # more steps than a finished job ran: the stage is not complete, so it goes on from its checkpoint
    cfg = load_config(None, ["train.steps=30"])
    assert not TrainStage().complete(cfg, {"step": 20}) and TrainStage().complete(cfg, {"step": 30})
    assert not TrainStage().complete(cfg, {"trained": False})        # a steps: 0 finish trained nothing
    assert TrainStage().complete(load_config(None, ["train.steps=0"]), {"trained": False})
